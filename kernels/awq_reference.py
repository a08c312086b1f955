"""The AWQ int4 GEMM layout in plain torch: unpacking, dequantizing, and the reference matmul.

Layout (the one ``tools/awq_pack.py`` writes and transformers loads as ``quant_method="awq", version="gemm"``), for a
linear layer with ``K`` inputs, ``N`` outputs and ``G`` inputs per group:

* ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/G, N/8]``, ``scales`` float16 ``[K/G, N]``;
* nibble ``j`` (bits ``4j..4j+3``) of packed column ``c`` holds column ``8c + AWQ_ORDER[j]``;
* the weight, shaped ``[K, N]`` (``x @ W``), is ``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

Deliberately simple (it shares no code with the Triton kernel in :mod:`.awq_int4`, whose tests use it as the oracle);
it is also the CPU path of :class:`~kvboost_hf.kernels.awq_linear.AwqInt4Linear` when Triton cannot run.
"""

from __future__ import annotations

import torch

from kvboost_hf.core.errors import ConfigError

BITS = 4
PACK = 32 // BITS  # int4 codes per int32
MIN_GROUP_SIZE = 16  # the Triton kernel's tl.dot needs input tiles of at least 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j holds column 8c + AWQ_ORDER[j]
MAX_CODE = (1 << BITS) - 1


def _shifts(device: torch.device) -> torch.Tensor:
    """Bit offset of column ``8c + r`` in its int32, for ``r`` = 0..7 (the inverse of AWQ_ORDER, times 4)."""
    nibble = [AWQ_ORDER.index(column) for column in range(PACK)]
    return torch.tensor([BITS * j for j in nibble], dtype=torch.int32, device=device)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, cols/8]`` in the AWQ nibble order to int32 codes in ``[0, 15]``, ``[rows, cols]``."""
    rows, groups = packed.shape
    return ((packed[:, :, None] >> _shifts(packed.device)) & MAX_CODE).reshape(rows, groups * PACK)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight ``[K, N]`` (inputs x outputs) that an AWQ GEMM triple stands for."""
    inputs, outputs = qweight.shape[0], scales.shape[1]
    codes = unpack_int4(qweight).reshape(inputs // group_size, group_size, outputs)
    zeros = unpack_int4(qzeros)[:, None, :]
    return ((codes - zeros).float() * scales.float()[:, None, :]).reshape(inputs, outputs)


def awq_reference_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W + bias`` with ``W`` dequantized and cast to ``x.dtype`` first (``x``: ``[..., K]``; result in
    ``x.dtype``, ``[..., N]``)."""
    weight = dequantize_awq(qweight, qzeros, scales, group_size).to(x.dtype)
    out = x @ weight
    return out if bias is None else out + bias.to(x.dtype)


def check_group_size(group_size: object) -> None:
    """Raise ConfigError unless ``group_size`` is a power of two >= :data:`MIN_GROUP_SIZE` (the kernel's tile floor;
    every int4 path checks it, so a checkpoint packed for the CPU also runs on a GPU)."""
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < MIN_GROUP_SIZE
        or group_size & (group_size - 1)
    ):
        raise ConfigError(f"group_size must be a power of two >= {MIN_GROUP_SIZE}, got {group_size!r}")
