"""Float64 reference attention with exactly the contract of :func:`kvboost_hf.kernels.flash_attention.flash_attention`.

Deliberately naive (materialises the full score matrix and repeats K/V heads) so that it shares no code with the
kernel; use it only to check numerics on small shapes.
"""

from __future__ import annotations

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    mask: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``[B, Lq, H, D]`` in float64; fully masked query rows are zeros."""
    batch, heads, num_q, head_dim = q.shape
    num_k = k.shape[2]
    group = heads // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scores = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else head_dim**-0.5)
    allowed = torch.ones(batch, heads, num_q, num_k, dtype=torch.bool, device=q.device)
    if causal:
        pos = (torch.arange(num_q, device=q.device) + num_k - num_q) if q_pos is None else q_pos.long()
        allowed = allowed & (torch.arange(num_k, device=q.device) <= pos.expand(batch, num_q)[:, None, :, None])
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        scores = scores + mask.double()
        allowed = allowed & (scores > float("-inf"))
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v64).transpose(1, 2)
