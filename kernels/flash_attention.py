"""Triton forward attention with online softmax (FlashAttention-2 tiling) and split-K decoding.

Layout contract (the one transformers' ``AttentionInterface`` uses):

* ``q``: ``[B, H, Lq, D]``, ``k``/``v``: ``[B, H_kv, Lk, D]`` with ``H % H_kv == 0`` (GQA); K/V are never repeated:
  one program handles all ``G = H // H_kv`` query heads of a K/V head, so each K/V tile is loaded once per group.
* output: ``[B, Lq, H, D]`` in the dtype of ``q`` (written directly in the layout ``o_proj`` consumes).
* masking, combined with AND:
  - ``causal``: key ``j`` is visible to query ``i`` iff ``j <= pos[i]``, where ``pos`` are absolute key indices.
    ``q_pos`` (``[Lq]`` or ``[B, Lq]``) gives them explicitly (scattered queries being repaired); without it the
    queries are the last ``Lq`` keys (bottom-right alignment: prefill on a cache, decode, plain prefill).
  - ``mask``: a 4D tensor broadcastable to ``[B, H, Lq, Lk]``, boolean (True = attend) or additive float
    (0 = attend, ``-inf`` = masked). It is loaded tile by tile, so any pattern (padding, repair masks) is exact.
* fully masked query rows produce zeros (as torch SDPA's math backend does).

Rows of a program are (query, head-in-group) pairs, ``row = query * G + g``; softmax statistics are kept in fp32
in the log2 domain. With ``num_splits > 1`` the key range is cut into ``num_splits`` slices (flash-decoding); each
slice writes a normalised partial output and its log2-sum-exp, and ``_combine_kernel`` merges them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvboost_hf.core.errors import InputError
from kvboost_hf.kernels.cuda_compile import compile_variant

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Finite additive biases are clamped here so that ``bias * LOG2E`` cannot overflow to -inf: a row masked only with
# the dtype minimum (eager-style masks) then averages uniformly, as SDPA does, instead of becoming "fully masked".
MIN_BIAS: tl.constexpr = tl.constexpr(-1e37)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
PREFILL_SPLIT_RATIO = 8  # several row blocks are split only when the keys outnumber the queries this many times


# Kernels and their launch are hand-aligned (arguments grouped by role): the formatter leaves them alone.
# fmt: off
@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32; UPCAST feeds the MMA exact fp32 copies of the operands.

    UPCAST exists for the CPU interpreter, whose ``tl.dot`` multiplies the raw bits of bf16 operands (Triton 3.x);
    bf16 -> fp32 is exact, so the result equals a bf16 MMA with fp32 accumulation.
    """
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, mask_ptr, qpos_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lm, stride_lh,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb,
    num_heads_kv, num_q, num_k, split_len, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_QPOS: tl.constexpr, MASK_KIND: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One program: BLOCK_M (query, group head) rows of one (batch, kv head) against one key slice.

    MASK_KIND: 0 no tensor mask, 1 boolean (stored as uint8, nonzero = attend), 2 additive float.
    qk_scale is softmax scale * log2(e). The key slice is [pid_s * split_len, (pid_s + 1) * split_len).
    """
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal row blocks first: better tail balance
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // num_heads_kv).to(tl.int64)  # batch offsets can pass 2**31 elements (large 4D masks)
    kvh = pid_bh % num_heads_kv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    row_ok = qi < num_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = q_ptr + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, num_k)
    if CAUSAL:
        if HAS_QPOS:
            pos = tl.load(qpos_ptr + b * stride_pb + qi, mask=row_ok, other=-1)
        else:
            pos = tl.where(row_ok, qi + (num_k - num_q), -1)
        hi = tl.minimum(hi, tl.max(pos, axis=0) + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    m_base = mask_ptr + b * stride_mb + h[:, None] * stride_mh + qi[:, None] * stride_mm

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        qk = _dot(q, kt, DOT_UPCAST, DOT_PRECISION) * qk_scale
        valid = row_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= pos[:, None])
        if MASK_KIND == 1:
            allowed = tl.load(m_base + offs_n[None, :] * stride_mn, mask=valid, other=0)
            valid = valid & (allowed != 0)
        if MASK_KIND == 2:
            bias = tl.load(m_base + offs_n[None, :] * stride_mn, mask=valid, other=0.0).to(tl.float32)
            valid = valid & (bias != float("-inf"))
            qk = qk + tl.maximum(bias, MIN_BIAS) * LOG2E
        qk = tl.where(valid, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    o_ptrs = (o_ptr + pid_s * stride_os + b * stride_ob + qi[:, None] * stride_om + h[:, None] * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_mass, m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + pid_s * stride_ls + b * stride_lb + qi * stride_lm + h * stride_lh, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, o_ptr, num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge split partials of one output row: out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max).

    part: [S, rows, HEAD_DIM] fp32 (normalised per split), lse: [S, rows] fp32 log2-sum-exp, out: [rows, HEAD_DIM].
    """
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + offs_s * num_rows + row, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    part = tl.load(part_ptr + (offs_s[:, None] * num_rows + row) * HEAD_DIM + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + row * HEAD_DIM + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class _LaunchConfig:
    """Tile sizes (rows x keys), warps and pipeline stages for one launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _launch_config(device: torch.device, dtype: torch.dtype, rows: int, block_d: int, masked: bool) -> _LaunchConfig:
    """Pick tiles: small ones for the CPU interpreter (so tests cross tile borders), FA2-like ones on GPU.

    A tensor mask is one more pipelined tile, so masked prefill uses 2 stages to stay in the shared-memory budget.
    """
    if device.type != "cuda":
        return _LaunchConfig(16, 16, 1, 1)
    decode = rows <= 64  # decode / short repair: one small row block streams the keys
    block_m = max(16, triton.next_power_of_2(rows)) if decode else 64 if dtype == torch.float32 else 128
    if dtype == torch.float32:
        return _LaunchConfig(block_m, 32, 4, 2)
    if decode:
        return _LaunchConfig(block_m, 64 if block_d > 64 else 128, 4, 3)
    return _LaunchConfig(block_m, 64, 8 if block_d > 64 else 4, 2 if masked else 3)


def _num_programs_target(device: torch.device) -> int:
    """Programs needed to fill the device: twice the SM count on CUDA, 1 elsewhere (no splitting by default)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _auto_splits(
    row_blocks: int, base_programs: int, num_q: int, num_k: int, block_n: int, device: torch.device
) -> int:
    """Split the key range when the grid cannot fill the device and the queries are a short suffix of the keys
    (decode, or a prompt's new tokens over a long reused cache: 23 queries over 32k keys on 4 K/V heads are 8
    programs for 132 SMs unsplit). Keeps at least 4 key tiles per split. A prefill whose queries are about as many
    as its keys is never split: its causal row blocks would leave many slices empty and pay for fp32 partials.
    """
    target = _num_programs_target(device)
    if base_programs >= target or (row_blocks > 1 and num_q * PREFILL_SPLIT_RATIO > num_k):
        return 1
    return max(1, min(math.ceil(target / base_programs), num_k // (4 * block_n), 64))


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise InputError(f"expected q [B,H,Lq,D] and k/v [B,Hkv,Lk,D], got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise InputError(f"incompatible shapes q {tuple(q.shape)} k {tuple(k.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InputError(f"unsupported dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[3] > MAX_HEAD_DIM:
        raise InputError(f"head dim {q.shape[3]} > {MAX_HEAD_DIM}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _prepare_mask(mask: torch.Tensor | None, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor | None, int]:
    """Return (mask expanded to [B, H, Lq, Lk] with zero strides for broadcast dims, MASK_KIND)."""
    if mask is None:
        return None, 0
    if mask.dim() != 4:
        raise InputError(f"mask must be 4D, got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8).expand(shape), 1
    if not mask.is_floating_point():
        raise InputError(f"mask must be boolean or floating point, got {mask.dtype}")
    return mask.expand(shape), 2


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention forward; returns ``[B, Lq, H, D]`` in ``q.dtype`` (see the module docstring for the contract).

    ``scale`` defaults to ``D ** -0.5``. ``q_pos`` (int, ``[Lq]`` or ``[B, Lq]``) is only used when ``causal``.
    ``num_splits`` cuts the key range across programs (flash-decoding); ``None`` picks it from the grid size.
    """
    _check_inputs(q, k, v)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    batch, heads, num_q, head_dim = q.shape
    heads_kv, num_k = k.shape[1], k.shape[2]
    group = heads // heads_kv
    out = torch.empty(batch, num_q, heads, head_dim, device=q.device, dtype=q.dtype)
    if num_q == 0:
        return out
    mask_t, mask_kind = _prepare_mask(mask, (batch, heads, num_q, num_k))
    qpos_t = None if q_pos is None or not causal else q_pos.to(q.device, torch.int32).expand(batch, num_q).contiguous()
    has_qpos = qpos_t is not None

    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = _launch_config(q.device, q.dtype, group * num_q, block_d, mask_kind != 0)
    row_blocks = triton.cdiv(group * num_q, cfg.block_m)
    if num_splits is None:
        num_splits = _auto_splits(row_blocks, row_blocks * batch * heads_kv, num_q, num_k, cfg.block_n, q.device)
    num_splits = max(1, min(num_splits, triton.cdiv(max(num_k, 1), cfg.block_n)))
    split_len = triton.cdiv(triton.cdiv(max(num_k, 1), num_splits), cfg.block_n) * cfg.block_n

    if num_splits == 1:
        target, lse = out, out  # lse is not written when WRITE_LSE is False
        o_strides = (0, *out.stride()[:3])
        l_strides: tuple[int, ...] = (0, 0, 0, 0)
    else:
        target = torch.empty(num_splits, batch, num_q, heads, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(num_splits, batch, num_q, heads, device=q.device, dtype=torch.float32)
        o_strides = target.stride()[:4]
        l_strides = lse.stride()
    m_strides = mask_t.stride() if mask_t is not None else (0, 0, 0, 0)

    grid = (row_blocks, batch * heads_kv, num_splits)
    _attn_fwd_kernel[grid](
        q, k, v, target, lse, mask_t if mask_t is not None else q, qpos_t if qpos_t is not None else q,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *o_strides, *l_strides, *m_strides,
        qpos_t.stride(0) if qpos_t is not None else 0,
        heads_kv, num_q, num_k, split_len, (scale if scale is not None else head_dim**-0.5) * LOG2E.value,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, HAS_QPOS=has_qpos, MASK_KIND=mask_kind, WRITE_LSE=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=q.dtype == torch.bfloat16 and q.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        num_rows = batch * num_q * heads
        _combine_kernel[(num_rows,)](
            target, lse, out, num_rows, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    return out


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_for_cuda(arch: int = 90) -> int:
    """Compile, without a GPU, kernel variants the launcher picks on CUDA for ``sm_<arch>``; return their count.

    Each dtype in a prefill and a split-K decode configuration, cycling through head dims 64/80/96/128, the
    mask kinds and causal modes. Raises ``RuntimeError`` under ``TRITON_INTERPRET=1`` or when a variant needs more
    than :data:`~kvboost_hf.kernels.cuda_compile.SHARED_MEMORY_BUDGET`.
    """
    variants = list(itertools.product(SUPPORTED_DTYPES, (4096, 4)))  # rows per (batch, kv head): prefill, decode
    for index, (dtype, rows) in enumerate(variants):
        split, mask_kind, head_dim = rows < 64, index % 3, (64, 80, 96, 128)[index % 4]
        block_d = triton.next_power_of_2(head_dim)
        cfg = _launch_config(torch.device("cuda"), dtype, rows, block_d, mask_kind != 0)
        io = "*" + _TRITON_TYPES[dtype]
        types = {"q_ptr": io, "k_ptr": io, "v_ptr": io, "o_ptr": "*fp32" if split else io, "lse_ptr": "*fp32",
                 "mask_ptr": "*u8" if mask_kind == 1 else "*fp32", "qpos_ptr": "*i32", "qk_scale": "fp32"}
        constants = {
            "GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "CAUSAL": mask_kind == 0, "HAS_QPOS": split, "MASK_KIND": mask_kind, "WRITE_LSE": split,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "DOT_UPCAST": False,
        }
        compile_variant(_attn_fwd_kernel, arch, types, constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    combine_types = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "o_ptr": "*bf16"}
    compile_variant(_combine_kernel, arch, combine_types, {"HEAD_DIM": 80, "BLOCK_D": 128, "BLOCK_S": 8})
    return len(variants) + 1
