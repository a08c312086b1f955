"""Chunks landing in the RAM tier: device-to-host copies in flight, held back by the store until they complete.

A decode step that completes a chunk must not wait on the device. :func:`start_landing` allocates one page-locked
block per chunk (keys and values are views of it), issues the device-to-host copy without blocking on the source's
current stream and records an event after it. Until the event completes the block's bytes are undefined, so the
store serves and writes through only the landed entry (see :class:`~kvboost_hf.store.chunk_store.ChunkStore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvboost_hf.core.chunk_kv import ChunkKV

BLOCK_ALIGN = 64  # bytes: where the values start in a landing block (any element size divides it)


class CopyDone(Protocol):
    """Completion of an asynchronous copy; a ``torch.cuda.Event`` recorded after it is one."""

    def query(self) -> bool:
        """Whether the copy completed; never waits."""
        ...

    def synchronize(self) -> None:
        """Wait until the copy completed."""
        ...


@dataclass(frozen=True)
class Landing:
    """A chunk on its way into RAM.

    ``entry`` (host memory) holds the K/V only once ``done`` reports complete. The device tensors the copy reads are
    not kept: torch's caching allocator hands their memory out again only to work queued after the copy on its
    stream (a 32k-token prompt's write-back would otherwise hold 1.8 GB of a 7B model's K/V on the device until its
    chunks landed). ``write_through``: landing also writes the entry to the lower tiers (a put); False for a GPU
    tier eviction, which those tiers got when it was put.
    """

    entry: ChunkKV
    done: CopyDone
    write_through: bool


def start_landing(entry: ChunkKV, write_through: bool) -> Landing | None:
    """Start copying ``entry`` into one page-locked host block; never waits on the device. None when ``entry``'s
    tensors are not both on one CUDA device (the caller copies it synchronously)."""
    device = entry.keys.device
    if device.type != "cuda" or entry.values.device != device:
        return None
    keys, values = entry.keys, entry.values
    values_offset = -(-_nbytes(keys) // BLOCK_ALIGN) * BLOCK_ALIGN
    block = torch.empty(values_offset + _nbytes(values), dtype=torch.uint8, pin_memory=True)
    host = ChunkKV(_view(block, 0, keys), _view(block, values_offset, values))
    host.keys.copy_(keys, non_blocking=True)
    host.values.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))  # the stream the copies were issued on
    return Landing(host, done, write_through)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``block`` from ``offset`` as a contiguous tensor of ``like``'s dtype and shape."""
    return block[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)
