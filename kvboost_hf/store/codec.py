"""Pickle-free serialization of stored chunks: a small header, raw tensor bytes, one checksum over both.

Layout (little-endian, every tensor starts at a multiple of 64 bytes from the start of the record)::

    0   magic     4s   b"KVBC"
    4   version   u16  FORMAT_VERSION
    6   form      u16  0 = raw ChunkKV, 1 = KIVI-quantized
    8   header    u32  bytes before the first tensor (prefix + body + padding)
    12  payload   u64  bytes from the first tensor to the end of the record
    20  digest    32s  SHA-256 of the whole record with this field zeroed
    52  body:     key length u16, key (ASCII), key dtype code u8, value dtype code u8, bits u8,
                  group size u32, key shape 4 x u32, value shape 4 x u32

The tensors that follow are implied by the body: raw form ``keys, values``; quantized form
``key codes, key scales, key zeros, value codes, value scales, value zeros`` (see :mod:`kvboost_hf.store.quantization`
for their shapes). The record names the key it was stored under: :func:`decode` rejects a record read under
another key (a value copied between keys or namespaces), one whose digest does not match, and one whose sizes
are inconsistent, by raising :class:`CorruptEntryError`. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys

import torch

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.errors import InputError, KVBoostError, MissingDependencyError
from kvboost_hf.store.base import StoredChunk
from kvboost_hf.store.quantization import QuantizedChunk, QuantizedTensor, packed_numel, stats_shape

if sys.byteorder != "little":  # raw tensor bytes are written in host order
    raise MissingDependencyError("kvboost_hf's storage format needs a little-endian host")

MAGIC = b"KVBC"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ32s")
_DIGEST_OFFSET = 20
_DIGEST_SIZE = 32
_BODY = struct.Struct("<BBBI4I4I")
_KEY_LEN = struct.Struct("<H")
_RAW, _QUANTIZED = 0, 1
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.float64: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
Shape = tuple[int, int, int, int]


class CorruptEntryError(KVBoostError, ValueError):
    """A record that must not be served: bad magic or version, wrong key, inconsistent sizes, digest mismatch."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


Layout = list[tuple[torch.dtype, tuple[int, ...]]]


def _layout(
    form: int, dtypes: tuple[torch.dtype, torch.dtype], bits: int, group: int, shapes: tuple[Shape, Shape]
) -> Layout:
    """``[(dtype, shape)]`` of the tensors of a record, in payload order."""
    if form == _RAW:
        return [(dtypes[0], shapes[0]), (dtypes[1], shapes[1])]
    out: Layout = []
    for shape, per_channel in ((shapes[0], True), (shapes[1], False)):
        stats = stats_shape(shape, group, per_channel)
        out += [(torch.uint8, (packed_numel(math.prod(shape), bits),)), (torch.float16, stats), (torch.float16, stats)]
    return out


def _tensor_spans(header_len: int, layout: Layout) -> tuple[list[int], int]:
    """Start offset of every tensor and the total record length."""
    offsets, pos = [], header_len
    for dtype, shape in layout:
        offsets.append(pos)
        pos = _align(pos + math.prod(shape) * dtype.itemsize)
    return offsets, pos


def encode(key: str, entry: StoredChunk) -> bytearray:
    """Serialize ``entry`` as stored under ``key`` (tensors are copied to host memory)."""
    if isinstance(entry, QuantizedChunk):
        k, v = entry.keys, entry.values
        if (k.bits, k.group_size) != (v.bits, v.group_size) or not k.per_channel or v.per_channel:
            raise InputError("quantized chunk must have keys per channel and values per token with equal settings")
        form, dtypes, bits, group = _QUANTIZED, (k.dtype, v.dtype), k.bits, k.group_size
        shapes = (k.shape, v.shape)
        tensors = [k.data, k.scale, k.zero, v.data, v.scale, v.zero]
    else:
        form, dtypes, bits, group = _RAW, (entry.keys.dtype, entry.values.dtype), 16, 0
        shapes = (_shape4(entry.keys), _shape4(entry.values))
        tensors = [entry.keys, entry.values]
    if any(d not in _DTYPE_CODES for d in dtypes):
        raise InputError(f"unsupported K/V dtypes {dtypes}")
    key_bytes = key.encode("ascii")
    body = _KEY_LEN.pack(len(key_bytes)) + key_bytes
    body += _BODY.pack(_DTYPE_CODES[dtypes[0]], _DTYPE_CODES[dtypes[1]], bits, group, *shapes[0], *shapes[1])
    header_len = _align(_PREFIX.size + len(body))
    offsets, total = _tensor_spans(header_len, _layout(form, dtypes, bits, group, shapes))
    record = bytearray(total)
    record[_PREFIX.size : _PREFIX.size + len(body)] = body
    out = torch.frombuffer(record, dtype=torch.uint8)
    for offset, tensor in zip(offsets, tensors, strict=True):
        flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        out[offset : offset + flat.numel()].copy_(flat)
    _PREFIX.pack_into(record, 0, MAGIC, FORMAT_VERSION, form, header_len, total - header_len, bytes(_DIGEST_SIZE))
    record[_DIGEST_OFFSET : _DIGEST_OFFSET + _DIGEST_SIZE] = _digest(record)
    return record


def storable(entry: StoredChunk) -> bool:
    """Whether :func:`encode` takes ``entry``'s K/V dtypes (a quantized entry's: those it was quantized from)."""
    return entry.keys.dtype in _DTYPE_CODES and entry.values.dtype in _DTYPE_CODES


def encode_each(items: list[tuple[str, StoredChunk]]) -> tuple[list[tuple[str, bytearray]], list[str]]:
    """:func:`encode` of each ``(key, entry)``: the records, and the keys of the entries it refused (a tier writes
    the others of a batch: one bad entry does not take its batch-mates down with it)."""
    records, refused = [], []
    for key, entry in items:
        try:
            records.append((key, encode(key, entry)))
        except InputError:
            refused.append(key)
    return records, refused


def intact(expected_key: str, record: bytes | bytearray | memoryview) -> bool:
    """Whether ``record`` decodes (checksum, key and layout) as the entry stored under ``expected_key``."""
    try:
        decode(expected_key, record)
    except CorruptEntryError:
        return False
    return True


def decode(expected_key: str, record: bytes | bytearray | memoryview) -> StoredChunk:
    """The entry in ``record``, verified; raises :class:`CorruptEntryError` if it must not be served.

    The returned tensors share memory with ``record`` when it is a writable buffer (no copy).
    """
    if isinstance(record, bytes) or (isinstance(record, memoryview) and record.readonly):
        record = bytearray(record)
    view = memoryview(record)
    if len(view) < _PREFIX.size:
        raise CorruptEntryError(f"record of {len(view)} bytes is shorter than its header")
    magic, version, form, header_len, payload_len, digest = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC or version != FORMAT_VERSION or form not in (_RAW, _QUANTIZED):
        raise CorruptEntryError(f"bad magic/version/form {magic!r}/{version}/{form}")
    if header_len < _PREFIX.size or header_len + payload_len != len(view):
        raise CorruptEntryError(f"record is {len(view)} bytes, its header says {header_len} + {payload_len}")
    if _digest(view) != digest:
        raise CorruptEntryError("checksum mismatch")
    key = _read_key(view)
    if key != expected_key:
        raise CorruptEntryError(f"record was stored under key {key[:16]}..., not {expected_key[:16]}...")
    k_code, v_code, bits, group, *dims = _BODY.unpack_from(view, _PREFIX.size + _KEY_LEN.size + len(key))
    if k_code not in _CODE_DTYPES or v_code not in _CODE_DTYPES:
        raise CorruptEntryError(f"unknown dtype codes {k_code}, {v_code}")
    dtypes = (_CODE_DTYPES[k_code], _CODE_DTYPES[v_code])
    shapes: tuple[Shape, Shape] = (tuple(dims[:4]), tuple(dims[4:]))
    if form == _QUANTIZED and group < 1:
        raise CorruptEntryError("quantized record with group size 0")
    layout = _layout(form, dtypes, bits, group, shapes)
    offsets, total = _tensor_spans(header_len, layout)
    if total != len(view):
        raise CorruptEntryError(f"tensor sizes add up to {total} bytes, record has {len(view)}")
    tensors = [
        torch.frombuffer(record, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)
        if math.prod(shape)
        else torch.empty(shape, dtype=dtype)
        for (dtype, shape), offset in zip(layout, offsets, strict=True)
    ]
    try:
        if form == _RAW:
            return ChunkKV(tensors[0], tensors[1])
        k_data, k_scale, k_zero, v_data, v_scale, v_zero = tensors
        return QuantizedChunk(
            QuantizedTensor(k_data, k_scale, k_zero, shapes[0], dtypes[0], bits, group, True),
            QuantizedTensor(v_data, v_scale, v_zero, shapes[1], dtypes[1], bits, group, False),
        )
    except ValueError as exc:
        raise CorruptEntryError(str(exc)) from exc


def _read_key(view: memoryview) -> str:
    (key_len,) = _KEY_LEN.unpack_from(view, _PREFIX.size)
    start = _PREFIX.size + _KEY_LEN.size
    if start + key_len + _BODY.size > len(view):
        raise CorruptEntryError("key runs past the header")
    try:
        return bytes(view[start : start + key_len]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptEntryError("key is not ASCII") from exc


def _digest(record: bytearray | memoryview) -> bytes:
    view = memoryview(record)
    h = hashlib.sha256(view[:_DIGEST_OFFSET])
    h.update(bytes(_DIGEST_SIZE))
    h.update(view[_DIGEST_OFFSET + _DIGEST_SIZE :])
    return h.digest()


def _shape4(t: torch.Tensor) -> Shape:
    return int(t.shape[0]), int(t.shape[1]), int(t.shape[2]), int(t.shape[3])
