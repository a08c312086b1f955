"""Stage 5b: turning a :class:`~kvboost_hf.reuse.plan.ReusePlan`'s hits into per-layer K/V tensors.

Two layouts:

* leading runs (:func:`assemble_columns`): a batch of left-padded rows, each appending its exact hits after the
  columns the cache holds; zeros stand left of a row's padding (the attention mask hides them);
* scattered (:func:`place_hits`): one row at full prompt length, every hit at its absolute position (approximate
  hits re-rotated there), zeros at the positions a repair forward is about to compute.

Both return new tensors on the model's device and dtype; stored entries are never modified.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvboost_hf.reuse.plan import Hit, RowPlan
from kvboost_hf.reuse.rope import KeyRotator


def _cat_or_only(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _stack_or_unsqueeze(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[L, H, T, D]`` per row -> ``[L, B, H, T, D]`` without a copy for a single row."""
    return rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)


def assemble_columns(
    row_hits: Sequence[Sequence[Hit]],
    pads: Sequence[int],
    start: int,
    stop: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` shaped ``[B, H_kv, stop - start, D]`` for columns ``[start, stop)``.

    Row ``i``'s hits must cover its tokens ``[first hit start, stop - pads[i])``; columns left of its padding are
    zeros.
    """
    reference = next(hit.entry for hits in row_hits for hit in hits)
    layers, heads, _, head_dim = reference.keys.shape
    per_row: list[tuple[torch.Tensor, torch.Tensor]] = []
    for pad, hits in zip(pads, row_hits, strict=True):
        lo, hi = start - pad, stop - pad  # token indices wanted for this row
        num_pad = min(max(0, -lo), stop - start)
        parts_k = [reference.keys.new_zeros(layers, heads, num_pad, head_dim)] if num_pad else []
        parts_v = [reference.values.new_zeros(layers, heads, num_pad, head_dim)] if num_pad else []
        if hi > max(lo, 0):
            offset = hits[0].span[0]
            keys = _cat_or_only([hit.entry.keys for hit in hits], dim=2)
            values = _cat_or_only([hit.entry.values for hit in hits], dim=2)
            parts_k.append(keys[:, :, max(lo, 0) - offset : hi - offset])
            parts_v.append(values[:, :, max(lo, 0) - offset : hi - offset])
        per_row.append((_cat_or_only(parts_k, dim=2), _cat_or_only(parts_v, dim=2)))
    all_k = _stack_or_unsqueeze([k for k, _ in per_row]).to(device=device, dtype=dtype, non_blocking=True)
    all_v = _stack_or_unsqueeze([v for _, v in per_row]).to(device=device, dtype=dtype, non_blocking=True)
    return zip(all_k.unbind(0), all_v.unbind(0), strict=True)


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
