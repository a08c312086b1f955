"""Stage 5b: turning a :class:`~kvboost_hf.reuse.plan.ReusePlan`'s hits into per-layer K/V tensors.

Two layouts:

* leading runs (:func:`write_leading_runs`): a batch of left-padded rows, each appending its exact hits after the
  columns the cache holds, written in place into the cache's layer buffers; zeros stand left of a row's padding
  (the attention mask hides them);
* scattered (:func:`place_hits`): one row at full prompt length, every hit at its absolute position (approximate
  hits re-rotated there), zeros at the positions a repair forward is about to compute.

Stored entries are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost_hf.core.errors import InputError
from kvboost_hf.reuse.plan import Hit, RowPlan
from kvboost_hf.reuse.rope import KeyRotator


def write_leading_runs(
    keys: torch.Tensor,
    values: torch.Tensor,
    row_hits: Sequence[Sequence[Hit]],
    pads: Sequence[int],
    start: int,
    stop: int,
) -> int:
    """Write columns ``[start, stop)`` of every row into ``keys``/``values`` (``[L, B, H_kv, capacity, D]``, the
    cache's layer buffers) in place: row ``i``'s hits at column ``pads[i] + token``, zeros left of its padding's
    end. Each reused byte is copied once, straight from where its tier holds it (``non_blocking``: pinned host
    memory overlaps the copy with what follows on the stream).

    Row ``i``'s hits must cover its tokens ``[max(0, start - pads[i]), stop - pads[i])`` (ValueError otherwise).
    Returns the number of bytes copied from the hits.
    """
    copied = 0
    for row, (pad, hits) in enumerate(zip(pads, row_hits, strict=True)):
        lo, hi = max(start - pad, 0), stop - pad  # token offsets wanted for this row
        num_pad = min(max(0, pad - start), stop - start)
        if num_pad:
            keys[:, row, :, start : start + num_pad].zero_()
            values[:, row, :, start : start + num_pad].zero_()
        covered = lo
        for hit in hits:
            first, last = max(hit.span[0], lo), min(hit.span[1], hi)
            if first >= last:
                continue
            if first != covered:
                break
            offset = hit.span[0]
            source_keys = hit.entry.keys[:, :, first - offset : last - offset]
            source_values = hit.entry.values[:, :, first - offset : last - offset]
            keys[:, row, :, pad + first : pad + last].copy_(source_keys, non_blocking=True)
            values[:, row, :, pad + first : pad + last].copy_(source_values, non_blocking=True)
            copied += source_keys.nbytes + source_values.nbytes
            covered = last
        if covered < hi:
            raise InputError(f"row {row}'s hits cover its tokens [{lo}, {covered}) but columns up to {stop} were asked")
    return copied


def place_hits(
    row: RowPlan, rotator: KeyRotator, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` shaped ``[L, 1, H_kv, row.num_tokens, D]`` with every hit at its position (up to
    ``row.limit``) and zeros elsewhere."""
    layers, heads, _, head_dim = row.hits[0].entry.keys.shape
    keys = torch.zeros(layers, 1, heads, row.num_tokens, head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    for hit in row.hits:
        start, end = hit.span[0], min(hit.span[1], row.limit)
        hit_keys = hit.entry.keys if hit.exact else rotator.rotate(hit.entry.keys, start)
        keys[:, 0, :, start:end] = hit_keys[:, :, : end - start].to(device=device, dtype=dtype)
        values[:, 0, :, start:end] = hit.entry.values[:, :, : end - start].to(device=device, dtype=dtype)
    return keys, values
