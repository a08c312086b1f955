"""The Triton attention kernel, run by the Triton interpreter on CPU, against the float64 reference.

Shapes are small but never multiples of the interpreter's 16x16 tiles, so every test crosses tile borders.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvboost_hf.kernels.reference import reference_attention


@pytest.fixture
def flash_attention(triton_interpreter):
    """The kernel's launcher, interpreted on CPU for the test that asks for it."""
    return triton_interpreter.flash_attention


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 80, 96, 128)
# (atol, rtol) against float64; fp16/bf16 dominated by rounding P to the input dtype and the output store.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def _qkv(
    batch: int, heads: int, heads_kv: int, num_q: int, num_k: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return (
        rand(batch, heads, num_q, head_dim),
        rand(batch, heads_kv, num_k, head_dim),
        rand(batch, heads_kv, num_k, head_dim),
    )


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_on_cache_gqa(flash_attention, dtype: torch.dtype, head_dim: int) -> None:
    """Fewer queries than keys (bottom-right causal) with 2 query heads per K/V head."""
    q, k, v = _qkv(2, 4, 2, 19, 45, head_dim, dtype)
    out = flash_attention(q, k, v)
    assert out.shape == (2, 19, 4, head_dim) and out.dtype == dtype
    _assert_matches(out, reference_attention(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, 5])
def test_decode_split_k(flash_attention, dtype: torch.dtype, num_splits: int) -> None:
    """One query against a long cache, key range split across programs and merged by the combine kernel."""
    q, k, v = _qkv(1, 8, 2, 1, 150, 64, dtype)
    _assert_matches(flash_attention(q, k, v, num_splits=num_splits), reference_attention(q, k, v))


@pytest.mark.parametrize("num_splits", [2, 7])
def test_short_prompt_over_a_long_cache_split_k(flash_attention, num_splits: int) -> None:
    """Several row blocks of queries (a prompt's new tokens, 7 query heads per K/V head) over a longer cache, the
    key range split: slices past some rows' causal limit hold no key for them and merge to the exact result."""
    q, k, v = _qkv(1, 14, 2, 9, 400, 64, torch.float32)
    _assert_matches(flash_attention(q, k, v, num_splits=num_splits), reference_attention(q, k, v))


def test_auto_splits_fill_the_device_for_short_queries_only(triton_interpreter, monkeypatch) -> None:
    module = sys.modules[triton_interpreter.flash_attention.__module__]
    monkeypatch.setattr(module, "_num_programs_target", lambda device: 264)  # an H200: 2 x 132 SMs
    cpu = torch.device("cpu")
    assert module._auto_splits(2, 8, 23, 32_000, 64, cpu) == 33  # 23 new tokens over a 32k-token cache
    assert module._auto_splits(1, 4, 1, 32_000, 64, cpu) == 64  # decode
    assert module._auto_splits(64, 256, 8_000, 8_000, 64, cpu) == 1  # a prefill
    assert module._auto_splits(2, 8, 23, 300, 64, cpu) == 1  # too few keys to split


@pytest.mark.parametrize(
    ("batch", "heads", "heads_kv", "num_q", "num_k"),
    [(1, 2, 2, 33, 33), (3, 8, 1, 7, 7), (2, 6, 3, 1, 1), (1, 4, 2, 2, 70)],
    ids=["mha-square", "mqa", "single-token", "two-queries"],
)
def test_ragged_shapes(flash_attention, batch: int, heads: int, heads_kv: int, num_q: int, num_k: int) -> None:
    q, k, v = _qkv(batch, heads, heads_kv, num_q, num_k, 80, torch.float16)
    _assert_matches(flash_attention(q, k, v), reference_attention(q, k, v))


def test_non_causal_and_custom_scale(flash_attention) -> None:
    q, k, v = _qkv(2, 4, 2, 21, 37, 64, torch.float32)
    out = flash_attention(q, k, v, causal=False, scale=0.3)
    _assert_matches(out, reference_attention(q, k, v, causal=False, scale=0.3))


def _scattered_positions(batch: int, num_q: int, num_k: int) -> torch.Tensor:
    """Distinct sorted key indices per batch row, the last one always the final key."""
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randperm(num_k - 1, generator=gen)[: num_q - 1].sort().values for _ in range(batch)]
    return torch.stack([torch.cat([r, torch.tensor([num_k - 1])]) for r in rows])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_scattered_query_positions(flash_attention, num_splits: int) -> None:
    """Repair forward: queries at arbitrary absolute positions, given as positions and as a 4D -inf mask."""
    q, k, v = _qkv(2, 4, 2, 9, 50, 96, torch.float16)
    pos = _scattered_positions(2, 9, 50)
    ref = reference_attention(q, k, v, q_pos=pos)
    _assert_matches(flash_attention(q, k, v, q_pos=pos, num_splits=num_splits), ref)
    float_mask = torch.zeros(2, 1, 9, 50).masked_fill(torch.arange(50) > pos[:, None, :, None], float("-inf"))
    _assert_matches(flash_attention(q, k, v, causal=False, mask=float_mask, num_splits=num_splits), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_left_padding_boolean_mask(flash_attention, dtype: torch.dtype) -> None:
    """sdpa-style boolean mask with left padding; query rows that see no key at all come out as zeros."""
    batch, num_q, num_k = 3, 24, 40
    q, k, v = _qkv(batch, 4, 2, num_q, num_k, 64, dtype)
    pad = torch.tensor([0, 5, 30])  # batch row 2 pads past the first queries (fully masked rows)
    keys = torch.arange(num_k)
    qpos = torch.arange(num_q) + num_k - num_q
    mask = (keys[None, None, None, :] <= qpos[None, None, :, None]) & (keys >= pad[:, None])[:, None, None, :]
    out = flash_attention(q, k, v, causal=False, mask=mask)
    ref = reference_attention(q, k, v, causal=False, mask=mask)
    _assert_matches(out, ref)
    assert torch.all(out[2, :14] == 0)


def test_additive_mask_per_head_with_finite_minimum(flash_attention) -> None:
    """Eager-style float mask (dtype minimum, not -inf) that differs per head, combined with split-K."""
    q, k, v = _qkv(1, 4, 2, 5, 64, 64, torch.float32)
    gen = torch.Generator().manual_seed(2)
    blocked = torch.rand(1, 4, 5, 64, generator=gen) < 0.5
    blocked[..., 0] = False
    mask = torch.zeros(1, 4, 5, 64).masked_fill(blocked, torch.finfo(torch.float32).min)
    mask[0, 1, 2] = torch.finfo(torch.float32).min  # a row blocked only by the minimum averages uniformly
    ref = reference_attention(q, k, v, causal=False, mask=mask)
    torch.testing.assert_close(ref[0, 2, 1], v[0, 0].double().mean(0))
    _assert_matches(flash_attention(q, k, v, causal=False, mask=mask, num_splits=3), ref)


def test_transformers_layout_strides(flash_attention) -> None:
    """q/k/v as transformers produces them: views transposed from [B, L, H, D]."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(2, 4, 2, 17, 17, 64, torch.float16))
    assert not q.is_contiguous()
    _assert_matches(flash_attention(q, k, v), reference_attention(q, k, v))


def test_rejects_bad_inputs(flash_attention) -> None:
    q, k, v = _qkv(1, 3, 2, 4, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="incompatible"):
        flash_attention(q, k, v)
    q, k, v = _qkv(1, 2, 2, 4, 4, 64, torch.float64)
    with pytest.raises(ValueError, match="dtypes"):
        flash_attention(q, k, v)


def test_compiles_for_hopper() -> None:
    """The real (not interpreted) kernels compile for sm_90 without a GPU, in a process without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = "from kvboost_hf.kernels.flash_attention import compile_for_cuda; print(compile_for_cuda(90))"
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
