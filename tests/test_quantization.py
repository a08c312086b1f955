"""KIVI quantization: error bound, axes (keys per channel, values per token), bytes, edge cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.store.quantization import QuantizedTensor, quantize, quantize_chunk


def _elementwise_scale(q: QuantizedTensor) -> torch.Tensor:
    """Each element's scale, shaped like the original tensor."""
    axis = 2 if q.per_channel else 3
    return q.scale.float().repeat_interleave(q.group_size, dim=axis).narrow(axis, 0, q.shape[axis])


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    tokens=st.integers(0, 70),
    dim=st.integers(1, 40),
    bits=st.sampled_from([4, 8]),
    group_size=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    magnitude=st.floats(1e-3, 1e3),
    offset=st.floats(-100, 100),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_error_is_at_most_half_a_step(
    layers, heads, tokens, dim, bits, group_size, dtype, magnitude, offset, per_channel, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(layers, heads, tokens, dim, generator=gen) * magnitude + offset).to(dtype)
    q = quantize(x, bits, group_size, per_channel)
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == dtype
    # Half a quantization step, plus float32 arithmetic and the cast of the dequantized value back to ``dtype`` (its
    # rounding scales with that value, which may be far larger than the element: a small one in a wide group).
    magnitudes = torch.maximum(x.float().abs(), out.float().abs())
    bound = _elementwise_scale(q) / 2 * 1.001 + magnitudes * torch.finfo(dtype).eps * 2 + 1e-6
    assert bool(((out.float() - x.float()).abs() <= bound).all())


def test_keys_are_quantized_per_channel():
    """An outlier channel (KIVI's observation about keys) must not cost the other channels their precision."""
    keys = torch.randn(2, 2, 64, 32)
    keys[..., 5] *= 1000
    q = quantize_chunk(keys, torch.randn_like(keys), 8, 32)
    assert tuple(q.keys.scale.shape) == (2, 2, 2, 32)  # [layers, heads, token groups, channels]
    error = (q.keys.dequantize() - keys).abs()
    normal = torch.ones(32, dtype=torch.bool)
    normal[5] = False
    assert float(error[..., normal].max()) < 0.03  # per-token statistics would give ~1000 * 8 / 255 / 2
    assert float(error[..., 5].max()) < 1000 * 8 / 255


def test_values_are_quantized_per_token():
    """An outlier token must not cost the other tokens their precision."""
    values = torch.randn(2, 2, 64, 32)
    values[:, :, 7] *= 1000
    q = quantize_chunk(torch.randn_like(values), values, 8, 32)
    assert tuple(q.values.scale.shape) == (2, 2, 64, 1)  # [layers, heads, tokens, channel groups]
    error = (q.values.dequantize() - values).abs()
    normal = torch.ones(64, dtype=torch.bool)
    normal[7] = False
    assert float(error[:, :, normal].max()) < 0.03


@pytest.mark.parametrize(("bits", "limit"), [(8, 0.55), (4, 0.30)])
def test_bytes_against_float16(bits, limit):
    """SmolLM2-like chunk: 30 layers, 3 KV heads, 128 tokens, head_dim 64."""
    keys, values = torch.randn(30, 3, 128, 64), torch.randn(30, 3, 128, 64)
    q = quantize_chunk(keys, values, bits, 64)
    fp16_bytes = 2 * keys.numel() * 2
    assert q.nbytes / fp16_bytes <= limit


def test_constant_groups_are_exact_and_odd_sizes_pack():
    x = torch.full((1, 1, 3, 5), 0.1)
    for bits in (4, 8):
        q = quantize(x, bits, 4, per_channel=True)
        assert q.data.numel() == (15 if bits == 8 else 8)
        assert torch.allclose(q.dequantize(), x, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 20),
    dim=st.integers(1, 20),
    bits=st.sampled_from([4, 8]),
    extra=st.sampled_from([0, 1, 37, 2**40]),  # 2**40: padding to it cannot be allocated
    per_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_group_longer_than_the_axis_is_the_axis(tokens, dim, bits, extra, per_channel, seed):
    """A group covering the whole axis gives the bytes a group of exactly the axis gives, without padding the axis
    to ``group_size`` (``kv_group_size=2**20`` allocated 720 MiB for a 16 KiB chunk): the stored format is that of
    ``group_size``, so entries written before read back the same."""
    x = torch.randn(2, 2, tokens, dim, generator=torch.Generator().manual_seed(seed))
    length = tokens if per_channel else dim
    exact = quantize(x, bits, max(1, length), per_channel)
    large = quantize(x, bits, max(1, length) + extra, per_channel)
    assert large.group_size == max(1, length) + extra
    for field in ("data", "scale", "zero"):
        assert torch.equal(getattr(large, field), getattr(exact, field)), field
    assert torch.equal(large.dequantize(), exact.dequantize())


@pytest.mark.parametrize(("bits", "group_size", "message"), [(8.0, 4, "kv_cache_bits"), (4, 4.0, "group_size")])
def test_float_settings_are_refused_by_name(bits, group_size, message):
    """8.0 in (4, 8) is True: a float passed the check and failed inside as a TypeError."""
    with pytest.raises(ConfigError, match=f"{message} must be"):
        quantize(torch.randn(1, 1, 4, 4), bits, group_size, True)


def test_rejects_bad_input():
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError):
        quantize(x, 3, 4, True)
    with pytest.raises(ValueError):
        quantize(x, 8, 0, True)
    with pytest.raises(ValueError):
        quantize(x.view(4, 4), 8, 4, True)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        quantize(x, 8, 4, True)
    with pytest.raises(ValueError):
        quantize(torch.full((1, 1, 2, 2), 1e6), 8, 4, True)
