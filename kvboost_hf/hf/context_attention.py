"""Attention over parallel contexts (APE-style, training-free): temperature and scaling on reused columns.

Documents stitched from the store by content key were each encoded without the others (in parallel). APE (Yang et
al., ICLR 2025) keeps their K/V as they are and changes how every *later* query attends to them: with ``T`` the
attention temperature and ``S`` the scaling factor, a query at or after :attr:`ContextAdjustment.query_start`

* divides its logits over the context columns ``C`` by ``T`` (``T < 1`` sharpens the spread-out attention of
  parallel encoding), and
* gives ``C`` the joint softmax mass ``exp(S * T * logsumexp_C(logits / T))`` beside the other columns' ordinary
  ``exp(logsumexp(logits))``.

Written as one softmax, that is the logits ``l_j / T + (S * T - 1) * logsumexp_C(l / T)`` on ``C`` and ``l_j``
elsewhere: with ``T = S = 1`` it is plain attention. Queries before ``query_start`` (the documents' own tokens in a
repair forward) attend plainly. This module is the math (eager PyTorch, any device); the ``"kvboost"`` attention
(:mod:`kvboost_hf.hf.attention`) runs it when a forward passes :data:`ADJUSTMENT_KWARG`, and the reuse cache
(:meth:`~kvboost_hf.hf.cache.ChunkReuseCache.attention_kwargs`) passes it for every forward after a prompt whose
approximate hits were loaded under a :class:`~kvboost_hf.core.config.RepairConfig` with ``context_temperature``
or ``context_scale`` set.

Differences from the APE paper, on purpose: the documents keep the positions they have in the prompt (the cache
rotates their keys there) instead of all starting at the same position, and the adjustment applies to the
columns loaded by content key, whether a repair recomputed some of their tokens or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADJUSTMENT_KWARG = "context_adjustment"
"""The forward keyword argument (reaching the attention function through transformers' ``**kwargs``)."""


@dataclass(frozen=True)
class ContextAdjustment:
    """One forward's adjustment: ``columns`` ``[B, W]`` bool marks the context key columns (cache columns, left
    padding included; columns at or past ``W`` are not context), ``query_start`` ``[B]`` the first position
    (RoPE position, padding excluded) whose queries are adjusted, ``temperature`` and ``scale`` > 0."""

    columns: torch.Tensor
    query_start: torch.Tensor
    temperature: float
    scale: float


QUERY_BLOCK = 256
"""Queries computed at once: bounds the fp32 logits held at a time to ``B * H * QUERY_BLOCK * Lk * 4`` bytes."""


def _block_mask(mask: torch.Tensor | None, rows: slice, num_q: int, num_k: int, device: torch.device) -> torch.Tensor:
    """Rows ``rows`` of ``mask`` (None: bottom-right causal; boolean True = attend; or additive) as an additive fp32
    mask ``[B|1, 1|H, len(rows), Lk]``."""
    if mask is None:
        queries = torch.arange(rows.start, rows.stop, device=device)[:, None]
        allowed = (torch.arange(num_k, device=device)[None, :] <= queries + num_k - num_q)[None, None]
    else:
        block = mask[..., rows, :num_k] if mask.shape[-2] > 1 else mask[..., :num_k]
        if block.dtype != torch.bool:
            return block.float()
        allowed = block
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))


def adjusted_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    adjustment: ContextAdjustment,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Attention of q ``[B, H, Lq, D]`` over k/v ``[B, H_kv, Lk, D]`` (grouped heads repeated) with the context
    adjustment; ``position_ids`` ``[B|1, Lq]`` are the queries' positions. Returns ``[B, Lq, H, D]`` in the
    query's dtype (computed in fp32, :data:`QUERY_BLOCK` queries at a time); a query row that the mask hides from
    every key gets zeros."""
    batch, heads, num_q, _ = query.shape
    num_k = key.shape[2]
    groups = heads // key.shape[1]
    keys = key.float().repeat_interleave(groups, dim=1).transpose(-1, -2)
    values = value.float().repeat_interleave(groups, dim=1)
    columns = torch.zeros(batch, num_k, dtype=torch.bool, device=query.device)
    width = min(num_k, adjustment.columns.shape[1])
    columns[:, :width] = adjustment.columns[:, :width].to(query.device)
    late = position_ids.to(query.device).expand(batch, num_q) >= adjustment.query_start.to(query.device)[:, None]
    blocks = []
    for start in range(0, num_q, QUERY_BLOCK):
        rows = slice(start, min(start + QUERY_BLOCK, num_q))
        logits = (query[:, :, rows].float() @ keys) * scaling
        logits = logits + _block_mask(mask, rows, num_q, num_k, query.device)
        adjusted = columns[:, None, None, :] & late[:, None, rows, None]  # [B, 1, rows, Lk]
        tempered = logits / adjustment.temperature
        context_lse = torch.where(adjusted, tempered, float("-inf")).logsumexp(-1, keepdim=True)
        context_lse = torch.where(context_lse.isfinite(), context_lse, 0.0)
        shift = (adjustment.scale * adjustment.temperature - 1.0) * context_lse
        logits = torch.where(adjusted, tempered + shift, logits)
        blocks.append(logits.softmax(-1).nan_to_num(0.0) @ values)  # a fully masked (padding) row: zeros
    return torch.cat(blocks, dim=2).transpose(1, 2).to(query.dtype)
