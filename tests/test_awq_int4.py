"""The Triton int4 AWQ linear, run by the Triton interpreter on CPU, against the dequantized float reference; the
``AwqInt4Linear`` layer and its swapping into models.

The oracle is float64 ``x @ W + bias`` with ``W`` dequantized by the plain-torch reference and rounded to the
activations' dtype (the kernel's contract). Shapes are small (the interpreter is slow) and never multiples of the
interpreter's 32-column tiles; M = 1 (GEMV), 3 and 17 (tensor-core tiles) run the fused kernel, M = 70 the
dequantize-then-matmul path.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_model

from kvboost_hf.kernels.awq_linear import AwqInt4Linear, replace_awq_linears
from kvboost_hf.kernels.awq_reference import awq_reference_matmul, dequantize_awq
from kvboost_hf.tools.awq_pack import dequantize_linear, int4_model, quantize_linear, round_trip_int4

# (rtol, atol, weight_rtol) against float64: one rounding of the output (fp16: 2^-11) plus fp32 accumulation. The
# interpreter converts fp32 to bf16 by truncation (CUDA rounds), so in bf16 the output may be off by up to 2^-7 of its
# value and every dequantized weight by up to 2^-7 of its own (weight_rtol, applied to |x| @ |W|).
TOLERANCES = {
    torch.float32: (1e-5, 1e-4, 0.0),
    torch.float16: (2**-10, 1e-3, 0.0),
    torch.bfloat16: (2**-7, 1e-2, 2**-7),
}


@pytest.fixture
def awq_kernel(monkeypatch):
    """The kernel's launcher, interpreted on CPU (conftest sets TRITON_INTERPRET=1 before Triton is imported)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return importlib.import_module("kvboost_hf.kernels.awq_int4").awq_int4_matmul


def packed_layer(in_features: int, out_features: int, group_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return quantize_linear(weight, group_size)


def oracle(
    x: torch.Tensor, packed: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result, and ``|x| @ |W|`` (the scale of errors made in the weights)."""
    weight = dequantize_linear(packed["qweight"], packed["qzeros"], packed["scales"], group_size).t()
    out = x.double() @ weight.to(x.dtype).double()
    return (out if bias is None else out + bias.double()), x.double().abs() @ weight.double().abs()


def assert_close(got: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> None:
    rtol, atol, weight_rtol = TOLERANCES[dtype]
    value, magnitude = expected
    error = (got.double() - value).abs()
    allowed = atol + rtol * value.abs() + weight_rtol * magnitude
    assert got.dtype == dtype and (error <= allowed).all(), f"max excess {(error - allowed).max().item():.3g}"


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "group_size", "dtype", "bias"),
    [
        (1, 128, 72, 32, torch.float32, True),
        (1, 256, 40, 128, torch.float16, False),
        (3, 128, 72, 64, torch.float16, True),
        (17, 256, 40, 128, torch.bfloat16, True),
        (3, 64, 104, 32, torch.float32, False),
        (70, 64, 48, 32, torch.float16, True),
        (70, 128, 40, 64, torch.float32, False),
    ],
)
def test_kernel_matches_the_dequantized_reference(awq_kernel, rows, in_features, out_features, group_size, dtype, bias):
    packed = packed_layer(in_features, out_features, group_size)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).half() if bias else None
    got = awq_kernel(x, packed["qweight"], packed["qzeros"], packed["scales"], group_size, b)
    assert got.shape == (rows, out_features)
    assert_close(got, oracle(x, packed, group_size, b), dtype)


@pytest.mark.parametrize(("rows", "splits"), [(1, 3), (5, 4)])
def test_split_inputs_sum_to_the_same_result(awq_kernel, rows, splits):
    """Split-K as the GPU picks it when the output tiles are few: 7 input tiles cut into 3 or 4 slices (the last one
    shorter), fp32 partials summed in a fixed order, bias added once."""
    packed = packed_layer(224, 40, 32)
    x = torch.randn(rows, 224, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(40).half()
    got = awq_kernel(x, packed["qweight"], packed["qzeros"], packed["scales"], 32, bias, splits=splits)
    assert_close(got, oracle(x, packed, 32, bias), torch.float32)


def test_kernel_reads_strided_rows_and_refuses_bad_operands(awq_kernel):
    packed = packed_layer(64, 40, 32)
    wide = torch.randn(5, 128)
    strided = wide[:, ::2]  # last-dimension stride 2: copied to contiguous rows
    got = awq_kernel(strided, packed["qweight"], packed["qzeros"], packed["scales"], 32)
    assert_close(got, oracle(strided, packed, 32, None), torch.float32)
    assert awq_kernel(wide[:0, :64], packed["qweight"], packed["qzeros"], packed["scales"], 32).shape == (0, 40)
    with pytest.raises(ValueError, match="x has 128 inputs"):
        awq_kernel(wide, packed["qweight"], packed["qzeros"], packed["scales"], 32)
    with pytest.raises(ValueError, match="power of two"):
        awq_kernel(wide[:, :64], packed["qweight"], packed["qzeros"], packed["scales"], 8)
    with pytest.raises(ValueError, match="do not match"):
        awq_kernel(wide[:, :64], packed["qweight"], packed["qzeros"], packed["scales"], 64)
    with pytest.raises(ValueError, match="not supported"):
        awq_kernel(wide[:, :64].double(), packed["qweight"], packed["qzeros"], packed["scales"], 32)


def test_layer_runs_the_kernel_interpreted_and_the_reference_without_triton(awq_kernel, monkeypatch):
    packed = packed_layer(128, 72, 64)
    bias = torch.randn(72).half()
    layer = AwqInt4Linear.from_packed(**packed, group_size=64, bias=bias)
    x = torch.randn(2, 3, 128, dtype=torch.float16)
    interpreted = layer(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    plain = layer(x)
    assert interpreted.shape == plain.shape == (2, 3, 72)
    expected = oracle(x.reshape(6, 128), packed, 64, bias)
    assert_close(interpreted.reshape(6, 72), expected, torch.float16)
    assert_close(plain.reshape(6, 72), expected, torch.float16)
    assert layer.packed_bytes == 128 * 9 * 4 + 2 * 9 * 4 + 2 * 72 * 2 + 72 * 2
    assert set(layer.state_dict()) == {"qweight", "qzeros", "scales", "bias"}
    with pytest.raises(ValueError, match="qzeros has shape"):
        AwqInt4Linear.from_packed(packed["qweight"], packed["qzeros"], packed["scales"], 32)


def test_reference_dequantizer_agrees_with_the_packer():
    packed = packed_layer(128, 24, 32)
    weight = dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"], 32)
    assert weight.shape == (128, 24)
    assert torch.equal(weight, dequantize_linear(packed["qweight"], packed["qzeros"], packed["scales"], 32).t())
    x = torch.randn(4, 128)
    assert torch.allclose(awq_reference_matmul(x, **packed, group_size=32), x @ weight)


class _ForeignAwqLinear(torch.nn.Module):
    """The shape of gptqmodel's AWQ layers before their first forward: packed tensors, ``group_size``, ``bias``."""

    def __init__(self, packed: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        for name, tensor in packed.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        self.group_size = group_size


def test_replace_awq_linears_swaps_foreign_layers_sharing_their_tensors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    packed = packed_layer(64, 16, 32)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), _ForeignAwqLinear(packed, 32, torch.ones(16).half()))
    assert replace_awq_linears(model) == 1
    layer = model[1]
    assert isinstance(layer, AwqInt4Linear) and layer.qweight is packed["qweight"] and layer.group_size == 32
    x = torch.randn(3, 16)
    expected = oracle(model[0](x), packed, 32, torch.ones(16))
    assert_close(model(x), expected, torch.float32)
    assert replace_awq_linears(model) == 0  # already swapped


def test_int4_model_computes_what_the_rounded_float_model_computes(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # the plain-torch path: fast enough for a whole model
    float_copy, packed = make_tiny_model("qwen2"), make_tiny_model("qwen2")
    assert round_trip_int4(float_copy, group_size=32) == int4_model(packed, group_size=32) == 14
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.layers.modules())
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = float_copy(ids).logits, packed(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_compiles_for_hopper() -> None:
    """The real (not interpreted) kernels compile for sm_90 without a GPU, in a process without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = "from kvboost_hf.kernels.awq_int4 import compile_for_cuda; print(compile_for_cuda(90))"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "18"
