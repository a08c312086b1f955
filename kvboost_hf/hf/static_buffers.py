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
one shape would otherwise pay a collection per request).
"""

from __future__ import annotations

import gc

import torch

from kvboost_hf.core.errors import InputError

Key = tuple[int, tuple[int, ...], torch.dtype, torch.device]


def _storage_users(tensor: torch.Tensor) -> int:
    """Tensors (views included) sharing ``tensor``'s storage, not counting the temporary storage handle."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def _handed_out(buffer: torch.Tensor) -> torch.Tensor:
    """A view of the whole ``buffer`` (a tensor of its own, so while the caller holds it the storage counts one
    more user), marked a static address."""
    view = buffer.view(buffer.shape)
    torch._dynamo.mark_static_address(view)
    return view


class StaticBufferPool:
    """Stacked static K/V buffers by (shape, dtype, device); see the module docstring.

    ``max_per_shape``: buffers of one shape kept (in use or free); a shape needing more gets fresh buffers that
    are not kept (its graphs then re-record for them)."""

    def __init__(self, max_per_shape: int = 2) -> None:
        if max_per_shape < 1:
            raise InputError(f"max_per_shape must be at least 1, got {max_per_shape}")
        self.max_per_shape = max_per_shape
        self._buffers: dict[Key, list[torch.Tensor]] = {}
        self.reused = 0
        """Buffers handed out again (each one a CUDA graph re-record saved on a GPU)."""
        self.allocated = 0
        """Buffers allocated (kept or not)."""
        self.collections = 0
        """Garbage collections run to find a free buffer (each one costs up to ~0.3 s in a large process)."""
        self._futile: set[Key] = set()  # shapes whose last collection freed nothing

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
        """A buffer of ``shape`` nobody else uses: a kept one whose users are all gone, else a fresh zero-filled
        one (kept while the shape has fewer than ``max_per_shape``). ``slot`` keeps apart buffers of one shape
        that one caller holds at once (keys 0, values 1), so each gets the same buffer as last time. Its contents
        are undefined past what the caller writes."""
        key = (slot, tuple(shape), dtype, torch.device(device))
        kept = self._buffers.setdefault(key, [])
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
            if collect:  # every buffer in real use: no collection for this shape until one comes back by itself
                self._futile.add(key)
        with torch.inference_mode(False):  # an ordinary tensor: crops and joins write it outside inference mode
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.allocated += 1
        if len(kept) < self.max_per_shape:
            kept.append(buffer)
        return _handed_out(buffer)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or free)."""
        return sum(buffer.nbytes for kept in self._buffers.values() for buffer in kept)

    def clear(self) -> None:
        """Forget every kept buffer (those in use stay with their caches until these let them go)."""
        self._buffers.clear()
