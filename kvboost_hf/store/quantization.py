"""KIVI-style asymmetric K/V quantization for what the store holds (the live cache stays in the model's dtype).

Keys are quantized **per channel**: every ``(layer, head, channel)`` gets its own scale and zero point,
computed over groups of ``group_size`` consecutive tokens (key outliers live in fixed channels). Values are
quantized **per token**: every ``(layer, head, token)`` gets its own scale and zero point, computed over groups
of ``group_size`` consecutive channels. A group at the end of an axis may be shorter than ``group_size``; a
``group_size`` at least the axis's length is one group of the whole axis (nothing is padded to ``group_size``).

Reconstruction is ``x = code * scale + zero`` with ``code`` in ``[0, 2**bits - 1]``. Scales and zeros are stored
as float16 and rounded so that the group range stays inside the representable codes; the error of every
element is then at most ``scale / 2`` (plus float32 rounding and the cast to the original dtype).
4-bit codes are packed two per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one).

Storage per element: ``bits / 8`` bytes of codes plus ``4 / group_size`` bytes of float16 scale and zero.
With ``group_size=64`` that is 0.53x (8 bits) and 0.28x (4 bits) of float16 storage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kvboost_hf.core.chunk_kv import pinned_copy
from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.core.values import is_integer

SUPPORTED_BITS = (4, 8)
DEFAULT_GROUP_SIZE = 64
STATS_DTYPE = torch.float16


def stats_shape(shape: tuple[int, ...], group_size: int, per_channel: bool) -> tuple[int, int, int, int]:
    """Shape of the scale and zero tensors of a ``[layers, heads, tokens, head_dim]`` tensor.

    Per channel (keys): ``[layers, heads, ceil(tokens / group_size), head_dim]``.
    Per token (values): ``[layers, heads, tokens, ceil(head_dim / group_size)]``.
    """
    layers, heads, tokens, dim = shape
    if per_channel:
        return layers, heads, -(-tokens // group_size), dim
    return layers, heads, tokens, -(-dim // group_size)


def _group_axis(per_channel: bool) -> int:
    """The axis whose consecutive elements share statistics: tokens for keys, channels for values."""
    return 2 if per_channel else 3


def _working_group(group_size: int, length: int) -> int:
    """Elements per group on an axis of ``length``: ``group_size``, or the whole axis when one group covers it (the
    same statistics, without padding the axis up to ``group_size``); at least 1."""
    return max(1, min(group_size, length))


def packed_numel(numel: int, bits: int) -> int:
    """Bytes of packed codes for ``numel`` elements."""
    return numel if bits == 8 else (numel + 1) // 2


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantized ``[layers, heads, tokens, head_dim]`` tensor.

    ``data`` holds the packed uint8 codes of the ``[layers, heads, tokens, head_dim]`` elements in row-major order.
    ``scale`` and ``zero`` are float16 shaped :func:`stats_shape`. ``dtype`` is the dtype to dequantise to.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    bits: int
    group_size: int
    per_channel: bool

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        expected_stats = stats_shape(self.shape, self.group_size, self.per_channel)
        if (
            not (is_integer(self.bits) and self.bits in SUPPORTED_BITS)
            or self.data.dtype != torch.uint8
            or self.data.numel() != packed_numel(numel, self.bits)
            or tuple(self.scale.shape) != expected_stats
            or tuple(self.zero.shape) != expected_stats
        ):
            raise InputError(f"inconsistent quantized tensor: shape {self.shape}, bits {self.bits}")

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))

    def to(self, device: torch.device, non_blocking: bool = False) -> QuantizedTensor:
        return QuantizedTensor(
            self.data.to(device, non_blocking=non_blocking),
            self.scale.to(device, non_blocking=non_blocking),
            self.zero.to(device, non_blocking=non_blocking),
            self.shape,
            self.dtype,
            self.bits,
            self.group_size,
            self.per_channel,
        )

    def pinned(self) -> QuantizedTensor:
        """This tensor with its codes and statistics in page-locked host memory."""
        return dataclasses.replace(
            self, data=pinned_copy(self.data), scale=pinned_copy(self.scale), zero=pinned_copy(self.zero)
        )

    def dequantize(self) -> torch.Tensor:
        """The ``[layers, heads, tokens, head_dim]`` tensor in ``dtype``."""
        axis = _group_axis(self.per_channel)
        length = self.shape[axis]
        codes = _unpack(self.data, self.bits, math.prod(self.shape)).view(self.shape)
        group = _working_group(self.group_size, length)
        pad = -length % group
        if pad:
            pad_widths = (0, 0, 0, pad) if self.per_channel else (0, pad)
            codes = torch.nn.functional.pad(codes, pad_widths)
        groups = codes.unflatten(axis, (-1, group)).to(torch.float32)
        scale, zero = self.scale.unsqueeze(axis + 1), self.zero.unsqueeze(axis + 1)
        out = torch.addcmul(zero.float(), groups, scale.float()).flatten(axis, axis + 1)
        if pad:
            out = out.narrow(axis, 0, length)
        return out.to(self.dtype).contiguous()


@dataclass(frozen=True)
class QuantizedChunk:
    """A chunk's K/V in quantized form: keys per channel, values per token."""

    keys: QuantizedTensor
    values: QuantizedTensor

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def pinned(self) -> QuantizedChunk:
        """This entry in page-locked host memory (see :meth:`ChunkKV.pinned`)."""
        return QuantizedChunk(self.keys.pinned(), self.values.pinned())

    def to(self, device: torch.device, non_blocking: bool = False) -> QuantizedChunk:
        return QuantizedChunk(self.keys.to(device, non_blocking), self.values.to(device, non_blocking))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` in the dtype they were quantized from."""
        return self.keys.dequantize(), self.values.dequantize()


def quantize(x: torch.Tensor, bits: int, group_size: int, per_channel: bool) -> QuantizedTensor:
    """Quantize a ``[layers, heads, tokens, head_dim]`` tensor (see the module docstring for the axes).

    Raises ConfigError for ``bits`` not an int in :data:`SUPPORTED_BITS` or ``group_size`` not an int >= 1, and
    InputError for values that are not finite or do not fit float16 statistics.
    """
    if not (is_integer(bits) and bits in SUPPORTED_BITS):
        raise ConfigError(f"kv_cache_bits must be one of {SUPPORTED_BITS} for quantization, got {bits!r}")
    if not (is_integer(group_size) and group_size >= 1):
        raise ConfigError(f"group_size must be an integer >= 1, got {group_size!r}")
    if x.dim() != 4:
        raise InputError(f"expected [layers, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    shape = (int(x.shape[0]), int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
    codes, scale, zero = _quantize_along(x.float(), _group_axis(per_channel), bits, group_size)
    return QuantizedTensor(_pack(codes.reshape(-1), bits), scale, zero, shape, x.dtype, bits, group_size, per_channel)


def quantize_chunk(keys: torch.Tensor, values: torch.Tensor, bits: int, group_size: int) -> QuantizedChunk:
    """KIVI: keys per channel (grouped along tokens), values per token (grouped along channels)."""
    return QuantizedChunk(quantize(keys, bits, group_size, True), quantize(values, bits, group_size, False))


def _quantize_along(
    x: torch.Tensor, axis: int, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, shape of ``x``), scale and zero (float16, ``ceil(n / group_size)`` groups on ``axis``)."""
    if not bool(torch.isfinite(x).all()):
        raise InputError("cannot quantize K/V that contain inf or nan")
    n = x.shape[axis]
    group = _working_group(group_size, n)
    pad = -n % group
    if pad:  # replicating the last element keeps every group's min and max unchanged
        last = x.narrow(axis, n - 1, 1)
        x = torch.cat([x, last.expand(*[pad if d == axis else -1 for d in range(x.dim())])], dim=axis)
    groups = x.unflatten(axis, (-1, group))
    lo, hi = groups.amin(dim=axis + 1), groups.amax(dim=axis + 1)
    if lo.numel() and float(torch.maximum(lo.abs(), hi.abs()).max()) > torch.finfo(STATS_DTYPE).max / 2:
        raise InputError("K/V magnitude exceeds what float16 quantization statistics can represent")
    levels = (1 << bits) - 1
    zero = lo.to(STATS_DTYPE)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    scale = ((hi - zero.float()) / levels).to(STATS_DTYPE)
    too_small = scale.float() * levels + zero.float() < hi
    scale = torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    divisor = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = ((groups - zero.float().unsqueeze(axis + 1)) / divisor.unsqueeze(axis + 1)).round_().clamp_(0, levels)
    codes = codes.flatten(axis, axis + 1).narrow(axis, 0, n).to(torch.uint8)
    return codes, scale, zero


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.contiguous()
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 8:
        return data
    return torch.stack([data & 0x0F, data >> 4], dim=-1).view(-1)[:numel]
