"""Static K/V buffers kept across caches, so a graphed forward finds its inputs at the addresses it was recorded
with.

A compiled graph (``torch.compile(mode="reduce-overhead")``) reads a static cache's buffers in place: they are
marked static addresses. When a later cache of the same shape brings buffers at other addresses, torch re-records
the CUDA graph (a warm-up run and a capture: about two eager forwards, paid inside the request's time to first
token) and, after ``torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit`` (128) such re-records,
stops graphing the function altogether. Every request builds a fresh cache, so without this pool every request
paid a re-record and a server fell back to eager forwards after 128 requests.

:class:`StaticBufferPool` hands out a stacked buffer per shape, ``[layers, rows, kv_heads, capacity, head_dim]``
(layer ``i``'s static buffer is its view ``[i]``), and hands the same buffer out again once nothing but the pool
references its storage.

Invariants: a buffer is handed out only while no tensor outside the pool (a cache's layer, a view of it, a
write-back's slice) shares its storage, so two caches never write one buffer; on CUDA the previous owner's
kernels and copies were queued on the same stream, so they complete before the next owner's; a buffer's columns
past what its new owner copies in hold an earlier owner's finite K/V, which every forward masks (static layers
attend only their held columns); the pool only grows when every buffer of a shape is in use, and keeps at most
:attr:`StaticBufferPool.max_per_shape` buffers of one shape. Before growing it runs one garbage collection (a
finished cache in a reference cycle, e.g. the one a compile traced, still counts as a user), but not again for a
shape whose last collection freed nothing until one of its buffers comes back by itself (concurrent batches of
one shape would otherwise pay a collection per request). Idle buffers (kept, no cache using them) hold device
memory between requests outside any K/V budget: at most ``max_free_bytes`` of them are kept (default 5% of the
device's memory), those of the least recently taken shapes dropped first, and all of them before an allocation
that ran out of memory is tried again.
"""

from __future__ import annotations

import gc
from typing import NamedTuple

import torch

from kvboost_hf.core.errors import InputError

Key = tuple[int, tuple[int, ...], torch.dtype, torch.device]


class StaticStacks(NamedTuple):
    """A static cache's buffers for every layer, taken from a pool: layer ``i`` holds views ``[i]`` of each."""

    keys: torch.Tensor
    """``[layers, rows, H_kv, capacity, D]``."""
    values: torch.Tensor
    """Shaped as ``keys``."""
    lengths: torch.Tensor
    """``[layers]`` int64: each layer's held columns on the device (a graph reads them in place, so they must keep
    their addresses from one request to the next as the K/V do)."""


def _storage_users(tensor: torch.Tensor) -> int:
    """Tensors (views included) sharing ``tensor``'s storage, not counting the temporary storage handle."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def _handed_out(buffer: torch.Tensor) -> torch.Tensor:
    """A view of the whole ``buffer`` (a tensor of its own, so while the caller holds it the storage counts one
    more user), marked a static address."""
    view = buffer.view(buffer.shape)
    torch._dynamo.mark_static_address(view)
    return view


def default_max_free_bytes(device: torch.device | str | None = None) -> int:
    """Idle buffer bytes a pool keeps by default: :data:`FREE_FRACTION` of a CUDA device's memory (the current
    device's when None and CUDA is there), else :data:`FREE_BYTES_OFF_CUDA`."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return int(torch.cuda.get_device_properties(device).total_memory * FREE_FRACTION)
    return FREE_BYTES_OFF_CUDA


FREE_FRACTION = 0.05
"""Share of a CUDA device's memory that buffers no cache uses may hold (the next request of their shape reuses
them; past it the least recently taken are dropped)."""
FREE_BYTES_OFF_CUDA = 1 << 30


class StaticBufferPool:
    """Stacked static K/V buffers by (shape, dtype, device); see the module docstring.

    ``max_per_shape``: buffers of one shape kept (in use or free); a shape needing more gets fresh buffers that
    are not kept (its graphs then re-record for them). ``max_free_bytes``: bytes of kept buffers no cache uses
    (idle device memory between requests) past which those of the least recently taken shapes are dropped (None:
    :func:`default_max_free_bytes`); an allocation that runs out of memory drops every idle buffer and tries once
    more."""

    def __init__(self, max_per_shape: int = 2, max_free_bytes: int | None = None) -> None:
        if max_per_shape < 1:
            raise InputError(f"max_per_shape must be at least 1, got {max_per_shape}")
        if max_free_bytes is not None and max_free_bytes < 0:
            raise InputError(f"max_free_bytes must be None or >= 0, got {max_free_bytes}")
        self.max_per_shape = max_per_shape
        self.max_free_bytes = max_free_bytes
        self._buffers: dict[Key, list[torch.Tensor]] = {}  # in order of last take: the most recent last
        self.reused = 0
        """Buffers handed out again (each one a CUDA graph re-record saved on a GPU)."""
        self.allocated = 0
        """Buffers allocated (kept or not)."""
        self.collections = 0
        """Garbage collections run to find a free buffer (each one costs up to ~0.3 s in a large process)."""
        self.dropped = 0
        """Idle buffers dropped (over ``max_free_bytes``, or to make room after running out of memory)."""
        self._futile: set[Key] = set()  # shapes whose last collection freed nothing

    def take(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        slot: int = 0,
        kept_with: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A buffer of ``shape`` nobody else uses: a kept one whose users are all gone, else a fresh zero-filled
        one (kept while the shape has fewer than ``max_per_shape``). ``slot`` keeps apart buffers of one shape
        that one caller holds at once (keys 0, values 1), so each gets the same buffer as last time;
        ``kept_with``: the shape it is kept under instead of its own (a companion of the buffers of that shape,
        such as a K/V stack's device lengths). Its contents are undefined past what the caller writes."""
        key = (slot, tuple(shape if kept_with is None else kept_with), dtype, torch.device(device))
        kept = self._buffers.pop(key, [])
        self._buffers[key] = kept  # the most recently taken shape last
        try:
            for collect in (False, True):
                if collect:
                    if not kept or key in self._futile:
                        break
                    gc.collect()  # a finished cache in a reference cycle (e.g. a compile's traced one) may hold one
                    self.collections += 1
                for buffer in kept:
                    if _storage_users(buffer) == 1:  # the pool's own tensor only
                        if not collect:
                            self._futile.discard(key)
                        self.reused += 1
                        return _handed_out(buffer)
                if collect:  # every buffer in real use: no collection for this shape until one comes back itself
                    self._futile.add(key)
            buffer = self._allocate(shape, dtype, device)
            if len(kept) < self.max_per_shape:
                kept.append(buffer)
            return _handed_out(buffer)
        finally:
            self._drop_idle(self._free_limit(device))

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh zero buffer; on running out of memory, the idle buffers dropped first and one more try."""
        with torch.inference_mode(False):  # an ordinary tensor: crops and joins write it outside inference mode
            try:
                buffer = torch.zeros(shape, dtype=dtype, device=device)
            except torch.OutOfMemoryError:
                self._drop_idle(0)
                buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.allocated += 1
        return buffer

    def _free_limit(self, device: torch.device) -> int:
        return self.max_free_bytes if self.max_free_bytes is not None else default_max_free_bytes(device)

    def _drop_idle(self, limit: int) -> None:
        """Drop idle kept buffers, those of the least recently taken shapes first, until at most ``limit`` bytes of
        them are left."""
        idle = [(key, buffer) for key, kept in self._buffers.items() for buffer in kept if _storage_users(buffer) == 1]
        excess = sum(buffer.nbytes for _, buffer in idle) - limit
        for key, buffer in idle:  # least recently taken first
            if excess <= 0:
                break
            self._buffers[key] = [kept for kept in self._buffers[key] if kept is not buffer]
            excess -= buffer.nbytes
            self.dropped += 1

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or free)."""
        return sum(buffer.nbytes for kept in self._buffers.values() for buffer in kept)
