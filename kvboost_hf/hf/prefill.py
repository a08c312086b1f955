"""Stage 7: forwards through a reuse cache, driven explicitly.

:func:`prepare_forward` turns one forward's keyword arguments into what is left to compute after the cache loaded
what the store holds (:meth:`~kvboost_hf.hf.cache.ChunkReuseCache.prefill`: plan, stitch, repair): the uncached tail,
or one sparse repair forward folded with the tail. :func:`forward` runs ``prepare_forward``, the model's
``forward`` and :meth:`~kvboost_hf.hf.cache.ChunkReuseCache.record`, in that order: the decode loop, the draft, the
engine's ``warm`` and shared prefixes call it, so none of them depends on hooks. The adapter in
:mod:`kvboost_hf.hf.hooks` calls the same two cache steps around a forward that ``generate()`` makes.

A cache without ``prefill``/``record`` (a ``DynamicCache``) is used as is.
"""

from __future__ import annotations

from typing import Any

import torch


def reuse_cache(cache: Any) -> Any | None:
    """``cache`` when it is a reuse cache (has ``prefill`` and ``record``), else None."""
    return cache if hasattr(cache, "prefill") and hasattr(cache, "record") else None


def prepare_forward(cache: Any, kwargs: dict[str, Any], *, report: bool = True) -> dict[str, Any]:
    """The forward's keyword arguments once ``cache`` loaded what it holds for them (``kwargs`` is updated).

    A forward that asks for every position's logits, hidden states or attentions is computed whole (and still
    recorded and written back); a decode step (no more new tokens than ``logits_to_keep``) has nothing to look up.
    ``report`` records the loaded tokens in ``cache.last_reuse`` (a generation's prompt forward).
    """
    fed = kwargs.get("input_ids")
    if fed is None or cache.expects_sparse_forward or not cache.reuse_enabled:
        return kwargs
    keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep < 1 or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        keep = fed.shape[1]  # the caller wants outputs for every position: skipping tokens would drop them
    cached = cache.num_columns
    if cached and fed.shape[1] <= keep:
        return kwargs
    full = torch.cat([cache.tokens.to(fed.device), fed], dim=1) if cached else fed
    pending = cache.prefill(full, kwargs.get("attention_mask"), keep=keep, defer=True, report=report)
    if pending.position_ids is not None:
        kwargs.update(pending.model_inputs())
    elif (skip := pending.cached_columns - cached) > 0:
        kwargs["input_ids"] = fed[:, skip:]
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"][..., skip:]
    return kwargs


def forward(model: torch.nn.Module, cache: Any, **kwargs: Any) -> Any:
    """One forward of ``model`` through ``cache`` (``past_key_values``), the reuse steps called explicitly: the
    model's ``forward`` is called directly, so the adapter's hooks (if installed) do not run. Returns the output."""
    kwargs = {**kwargs, "past_key_values": cache, "use_cache": True}
    reusing = reuse_cache(cache)
    if reusing is not None:
        kwargs = prepare_forward(reusing, kwargs)
    with torch.inference_mode():
        output = model.forward(**kwargs)
    if reusing is not None:
        reusing.record(kwargs.get("input_ids"))
    return output
