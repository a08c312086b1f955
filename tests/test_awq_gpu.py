"""GPU-only tests of AWQ int4 (``pytest -m gpu``, run by ``python -m kvboost_hf.bench gpu`` with
``TRITON_INTERPRET=0``): the compiled Triton int4 linear against the dequantized reference, its determinism,
streamed int4 == resident int4 (tokens and logits bitwise), and a device budget that holds (peak measured)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from conftest import greedy

from kvboost_hf.bench.shapes import random_awq_model
from kvboost_hf.kernels.awq_reference import dequantize_awq
from kvboost_hf.offload import (
    LayerStreamingConfig,
    decoder_layers,
    enable_layer_streaming,
    layer_device_bytes,
    plan_device_memory,
)
from kvboost_hf.tools.awq_pack import quantize_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
CUDA = torch.device("cuda")
# (rtol, atol) against float64: one rounding of the output (fp16 2^-11, bf16 2^-8) and fp32 accumulation
TOLERANCES = {torch.float16: (2**-10, 2e-3), torch.bfloat16: (2**-7, 2e-2)}


@pytest.fixture
def awq_kernel():
    """The compiled (not interpreted) launcher."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("GPU kernel tests need the compiled kernel: run them with TRITON_INTERPRET=0")
    pytest.importorskip("triton")
    return importlib.import_module("kvboost_hf.kernels.awq_int4").awq_int4_matmul


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize(("in_features", "out_features", "group_size"), [(4096, 1032, 128), (1536, 8968, 64)])
def test_kernel_matches_the_dequantized_reference(awq_kernel, dtype, rows, in_features, out_features, group_size):
    generator = torch.Generator().manual_seed(rows)
    packed = quantize_linear(torch.randn(out_features, in_features, generator=generator), group_size)
    bias = torch.randn(out_features, generator=generator).half()
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"], group_size).to(dtype)
    expected = x.double() @ weight.double() + bias.double()
    on_device = {k: v.to(CUDA) for k, v in packed.items()}
    got = awq_kernel(x.to(CUDA), **on_device, group_size=group_size, bias=bias.to(CUDA)).cpu()
    rtol, atol = TOLERANCES[dtype]
    assert got.dtype == dtype and torch.allclose(got.double(), expected, rtol=rtol, atol=atol)
    again = awq_kernel(x.to(CUDA), **on_device, group_size=group_size, bias=bias.to(CUDA)).cpu()
    assert torch.equal(got, again)  # split-K partials are summed in a fixed order


def test_streamed_int4_equals_resident_int4_bitwise():
    """fp16 activations, a random int4 Qwen2.5-0.5B shape: the same seed gives the same packed bytes whether the
    layers are built on the GPU (resident) or in host memory (streamed, pinned copies)."""
    resident = random_awq_model("qwen2.5-0.5b", device=CUDA, dtype="float16", group_size=128)
    streamed = random_awq_model("qwen2.5-0.5b", device=CUDA, dtype="float16", group_size=128, layer_device="cpu")
    handle = enable_layer_streaming(streamed, LayerStreamingConfig(keep_first_k=2, keep_last_k=1, device=CUDA))
    ids = torch.randint(1, 30000, (1, 40), generator=torch.Generator().manual_seed(0)).to(CUDA)
    expected, expected_logits = greedy(resident, ids, new=12)
    got, logits = greedy(streamed, ids, new=12)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    packed = [t for layer in decoder_layers(resident)[2:-1] for t in [*layer.parameters(), *layer.buffers()]]
    assert handle.stats().bytes_per_forward == sum(t.numel() * t.element_size() for t in packed)


def test_a_device_budget_holds():
    """A random int4 Qwen2.5-7B shape (~4.4 GB of layers, 2.2 GB of embeddings and head) under 5 GB: the planned
    streaming keeps torch's peak allocation within the budget during prefill and decode."""
    budget = 5 * 10**9
    model = random_awq_model("qwen2.5-7b", device=CUDA, dtype="bfloat16", group_size=128, layer_device="cpu")
    layers = decoder_layers(model)
    in_layers = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    other = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if id(t) not in in_layers)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    plan = plan_device_memory(
        budget, [layer_device_bytes(layer) for layer in layers], other, kv_bytes_per_token=per_token,
        min_kv_tokens=4096, workspace_bytes=10**9,
    )  # fmt: skip
    assert 0 < plan.resident_layers < len(layers)
    torch.cuda.reset_peak_memory_stats(CUDA)
    enable_layer_streaming(model, plan.streaming_config(device=CUDA))
    ids = torch.randint(1, 30000, (1, 512), generator=torch.Generator().manual_seed(0)).to(CUDA)
    greedy(model, ids, new=8)
    assert torch.cuda.max_memory_allocated(CUDA) <= budget
