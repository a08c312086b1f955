"""Triton int4 AWQ linear: ``x @ W + bias`` straight from the packed AWQ GEMM layout, no compiled extension.

Layout contract: see :mod:`.awq_reference` (``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/G, N/8]``,
``scales`` ``[K/G, N]``, ``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``). ``x`` is ``[M, K]`` in float16,
bfloat16 or float32; the result ``[M, N]`` is in ``x.dtype``.

Two paths, picked by the number of rows ``M`` (tokens in the forward):

* ``M <= FUSED_MAX_ROWS`` (decode, verify of a draft): :func:`_awq_fused_kernel` reads the packed weight once per
  row block, dequantizes each ``[BLOCK_K, BLOCK_N]`` tile in registers and accumulates in fp32 (``M == 1``: a
  GEMV by broadcast and sum; otherwise ``tl.dot`` on tiles of at least 16 rows). When the output tiles cannot fill
  the device the inputs are split (split-K) into fp32 partials that are summed in a fixed order (deterministic:
  the same inputs give the same bits, which streamed-versus-resident checks rely on).
* longer inputs (prefill): :func:`_awq_dequant_kernel` writes ``W`` in ``x.dtype`` and cuBLAS multiplies.

The dequantized weight is rounded to ``x.dtype`` before it is multiplied, in both paths (as the reference does).
``BLOCK_K`` divides the group size, so one tile of inputs shares one row of zeros and scales, and ``K`` (a multiple
of the group size) needs no masking.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.kernels.awq_reference import check_group_size
from kvboost_hf.kernels.cuda_compile import compile_variant

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FUSED_MAX_ROWS = 64  # more rows than this: dequantize once, then cuBLAS


# Kernels and their launch are hand-aligned (arguments grouped by role): the formatter leaves them alone.
# fmt: off
@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, n0, packed_n, n,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """``W[k0 : k0 + BLOCK_K, n0 : n0 + BLOCK_N]`` in fp32 (columns past ``n`` are zeros).

    Each int32 is loaded once and broadcast to its 8 columns; column ``8c + r`` sits in nibble
    ``r // 2 + 4 * (r % 2)`` (the inverse of AWQ_ORDER). The tile lies in one group (BLOCK_K divides GROUP_SIZE).
    """
    offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_c = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    c_ok = offs_c < packed_n
    group = k0 // GROUP_SIZE
    packed = tl.load(qw_ptr + offs_k[:, None] * packed_n + offs_c[None, :], mask=c_ok[None, :], other=0)
    packed_zeros = tl.load(qz_ptr + group * packed_n + offs_c, mask=c_ok, other=0)
    q = tl.reshape(tl.broadcast_to(packed[:, :, None], (BLOCK_K, BLOCK_N // 8, 8)), (BLOCK_K, BLOCK_N))
    z = tl.reshape(tl.broadcast_to(packed_zeros[:, None], (BLOCK_N // 8, 8)), (BLOCK_N,))
    r = offs_n % 8
    shift = ((r // 2) + (r % 2) * 4) * 4
    q = (q >> shift[None, :]) & 0xF
    z = (z >> shift) & 0xF
    s = tl.load(s_ptr + group * n + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)
    return (q - z[None, :]).to(tl.float32) * s[None, :]


@triton.jit
def _awq_fused_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr,
    m, n, k, packed_n, k_per_split,
    stride_xm, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One program: rows ``[pid_m * BLOCK_M, +BLOCK_M)`` x columns ``[pid_n * BLOCK_N, +BLOCK_N)`` over the
    inputs ``[pid_k * k_per_split, +k_per_split)`` cut at ``k``; writes ``out[pid_k]`` (fp32 partials when split,
    else the result in the output dtype, bias added). USE_DOT False (one row): multiply-and-sum in fp32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < m
    n_ok = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, pid_n * BLOCK_N, packed_n, n, BLOCK_K, BLOCK_N, GROUP_SIZE)
        w = w.to(x.dtype)  # the weight rounded to the activations' dtype, as the reference does
        if USE_DOT:
            if DOT_UPCAST:
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _awq_dequant_kernel(
    qw_ptr, qz_ptr, s_ptr, w_ptr, n, packed_n,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    """``W[k-tile, n-tile]`` written in the output's dtype (row-major ``[K, N]``)."""
    k0 = tl.program_id(0) * BLOCK_K
    n0 = tl.program_id(1) * BLOCK_N
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, n0, packed_n, n, BLOCK_K, BLOCK_N, GROUP_SIZE)
    offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(w_ptr + offs_k[:, None] * n + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(offs_n < n)[None, :])
# fmt: on


@dataclass(frozen=True)
class AwqTiles:
    """Tile sizes and warps of one launch: ``block_m`` rows x ``block_n`` outputs x ``block_k`` inputs per
    program (``block_k`` divides the group size, ``block_n`` is a multiple of 8)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tiles(device: torch.device, rows: int, group_size: int, fused: bool) -> AwqTiles:
    """Small tiles for the CPU interpreter (tests cross tile borders, and it runs faster on few large ops);
    on CUDA: a wide GEMV for one row, 16-64-row tiles for tensor cores, 64x128 dequantize tiles."""
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    if device.type != "cuda":
        return AwqTiles(block_m, 32, min(group_size, 32), 1, 1)
    if not fused:
        return AwqTiles(1, 128, min(group_size, 64), 4, 1)
    if rows == 1:
        return AwqTiles(1, 64, min(group_size, 128), 4, 2)
    return AwqTiles(block_m, 64, min(group_size, 64), 4, 3)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(device: torch.device, tiles: int, k_tiles: int) -> int:
    """Split the inputs when the output tiles cannot fill the device (twice its SMs), keeping at least 4 input
    tiles per split; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    target = 2 * _multiprocessors(device)
    if tiles >= target:
        return 1
    return max(1, min(math.ceil(target / tiles), k_tiles // 4, 32))


def check_awq_inputs(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> None:
    """Raise ValueError naming the first way the operands break the layout contract."""
    if x.dim() != 2 or qweight.dim() != 2:
        raise InputError(f"expected x [M, K] and qweight [K, N/8], got {tuple(x.shape)} and {tuple(qweight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise InputError(f"activations in {x.dtype} are not supported; use one of {SUPPORTED_DTYPES}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise InputError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    check_group_size(group_size)
    k, packed_n = qweight.shape
    if x.shape[1] != k or k % group_size:
        raise InputError(f"x has {x.shape[1]} inputs, qweight {k} (must be a multiple of group_size={group_size})")
    if qzeros.shape != (k // group_size, packed_n) or scales.shape != (k // group_size, packed_n * 8):
        raise InputError(
            f"qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not match qweight {tuple(qweight.shape)} "
            f"with group_size={group_size}"
        )


def awq_int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    tiles: AwqTiles | None = None,
) -> torch.Tensor:
    """``x @ W + bias`` for ``x`` ``[M, K]``; returns ``[M, N]`` in ``x.dtype`` (see the module docstring).
    ``splits``: how many slices the inputs are cut into on the fused path (None: enough to fill the device);
    ``tiles``: the fused launch's tiles (None: :func:`_tiles`' choice; ``bench awq --tune`` tries others)."""
    check_awq_inputs(x, qweight, qzeros, scales, group_size)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    packed_n = qweight.shape[1]
    n = packed_n * 8
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if rows == 0:
        return torch.empty(0, n, device=x.device, dtype=x.dtype)
    if rows > FUSED_MAX_ROWS:
        tiles = _tiles(x.device, rows, group_size, fused=False)
        weight = torch.empty(k, n, device=x.device, dtype=x.dtype)
        grid = (k // tiles.block_k, triton.cdiv(n, tiles.block_n))
        _awq_dequant_kernel[grid](
            qweight, qzeros, scales, weight, n, packed_n,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_SIZE=group_size,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
        out = x @ weight
        return out if bias is None else out + bias.to(x.dtype)
    if tiles is None:
        tiles = _tiles(x.device, rows, group_size, fused=True)
    elif group_size % tiles.block_k or tiles.block_n % 8 or tiles.block_m < (1 if rows == 1 else 16):
        raise ConfigError(f"{tiles} does not fit {rows} rows and group_size={group_size}")
    grid_mn = (triton.cdiv(rows, tiles.block_m), triton.cdiv(n, tiles.block_n))
    k_tiles = k // tiles.block_k
    if splits is None:
        splits = _splits(x.device, grid_mn[0] * grid_mn[1], k_tiles)
    splits = max(1, min(splits, k_tiles))
    k_per_split = triton.cdiv(k_tiles, splits) * tiles.block_k
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        out = torch.empty(1, rows, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(splits, rows, n, device=x.device, dtype=torch.float32)
    use_bias = bias is not None and splits == 1
    _awq_fused_kernel[(grid_mn[0], grid_mn[1], splits)](
        x, qweight, qzeros, scales, bias if use_bias else x, out,
        rows, n, k, packed_n, k_per_split,
        x.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_SIZE=group_size,
        USE_DOT=rows > 1, DOT_UPCAST=x.device.type != "cuda",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", HAS_BIAS=use_bias,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits == 1:
        return out[0]
    total = out.sum(0)
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)


_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_for_cuda(arch: int = 90) -> int:
    """Compile, without a GPU, the variants the launcher picks on CUDA for ``sm_<arch>``; return their count: per
    dtype, the GEMV (1 row), the tensor-core tile (8 and 64 rows), split and not, with and without bias, and the
    dequantize kernel, across group sizes 32/64/128. Raises ``RuntimeError`` under ``TRITON_INTERPRET=1`` or when a
    variant needs more shared memory than the budget."""
    cuda = torch.device("cuda")
    count = 0
    for index, (dtype, rows) in enumerate((d, r) for d in SUPPORTED_DTYPES for r in (1, 8, 64)):
        group_size, split = (32, 64, 128)[index % 3], index % 2 == 1
        tiles = _tiles(cuda, rows, group_size, fused=True)
        io = "*" + _TRITON_TYPES[dtype]
        types = {"x_ptr": io, "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "bias_ptr": "*fp16",
                 "out_ptr": "*fp32" if split else io}  # fmt: skip
        constants = {
            "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_SIZE": group_size,
            "USE_DOT": rows > 1, "DOT_UPCAST": False, "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "HAS_BIAS": not split,
        }  # fmt: skip
        compile_variant(_awq_fused_kernel, arch, types, constants, num_warps=tiles.num_warps,
                        num_stages=tiles.num_stages)  # fmt: skip
        tiles = _tiles(cuda, 4096, group_size, fused=False)
        constants = {"BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_SIZE": group_size}
        types = {"qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "w_ptr": io}
        compile_variant(_awq_dequant_kernel, arch, types, constants, num_warps=tiles.num_warps, num_stages=1)
        count += 2
    return count
