"""Stage 7: an optional adapter that lets ``generate()`` and ``forward()`` drive a reuse cache.

:class:`~kvboost_hf.hf.cache.ChunkReuseCache` does its work in two explicit calls, ``prefill()`` and ``save()``,
so it also works where these hooks cannot run (call them yourself). Installed once per model, the adapter is
inert unless ``past_key_values`` is such a cache:

* a forward pre-hook calls ``prefill()`` on the forward's tokens and replaces the inputs with what is left to
  compute (the uncached tail, or one sparse repair forward folded with the tail); a forward that asks for every
  position's logits, hidden states or attentions is computed whole (and still recorded and written back);
* a forward hook calls ``record()`` with the tokens the forward computed;
* a wrapper of ``generate`` refuses a prompt that does not extend what the cache holds (instead of silently
  attending to stale K/V), adds :class:`~kvboost_hf.hf.generation.ChunkWriteBack` to the logits processors
  (write-back as generation proceeds) and saves the unfinished last chunk when generation ends.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import LogitsProcessorList

from kvboost_hf.hf.generation import ChunkWriteBack

_INSTALLED = "_kvboost_hooks_installed"


def _reuse_cache(kwargs: dict[str, Any]) -> Any | None:
    cache = kwargs.get("past_key_values")
    return cache if hasattr(cache, "prefill") and hasattr(cache, "record") else None


def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    cache = _reuse_cache(kwargs)
    if cache is None:
        return None
    if args and "input_ids" not in kwargs:
        kwargs["input_ids"], args = args[0], args[1:]
    fed = kwargs.get("input_ids")
    if fed is None or cache.expects_sparse_forward or not cache.reuse_enabled:
        return args, kwargs
    keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep < 1 or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        keep = fed.shape[1]  # the caller wants outputs for every position: skipping tokens would drop them
    cached = cache.num_columns
    if cached and fed.shape[1] <= keep:
        return args, kwargs  # a decode step: nothing to look up
    full = torch.cat([cache.tokens.to(fed.device), fed], dim=1) if cached else fed
    pending = cache.prefill(full, kwargs.get("attention_mask"), keep=keep, defer=True, report=cache.prompt_forward_next)
    if pending.position_ids is not None:
        kwargs.update(pending.model_inputs())
    elif (skip := pending.cached_columns - cached) > 0:
        kwargs["input_ids"] = fed[:, skip:]
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"][..., skip:]
    return args, kwargs


def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _reuse_cache(kwargs)
    if cache is not None:
        cache.record(kwargs.get("input_ids"))


def _wrap_generate(model: torch.nn.Module) -> None:
    generate = getattr(model, "generate", None)
    if generate is None:
        return

    @functools.wraps(generate)
    def generate_with_write_back(*args: Any, **kwargs: Any) -> Any:
        cache: Any = kwargs.get("past_key_values")
        if not hasattr(cache, "save"):
            return generate(*args, **kwargs)
        input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if isinstance(input_ids, torch.Tensor) and not input_ids.is_floating_point():
            cache.check_extends(input_ids, kwargs.get("attention_mask"))
        processors = LogitsProcessorList(kwargs.get("logits_processor") or [])
        if not any(isinstance(p, ChunkWriteBack) and p.cache is cache for p in processors):
            processors.append(ChunkWriteBack(cache))
        kwargs["logits_processor"] = processors
        cache.prompt_forward_next = True
        output = generate(*args, **kwargs)
        drafting = getattr(kwargs.get("generation_config"), "is_assistant", False)
        cache.save(tail=not drafting)  # a draft round is not the end of a generation
        return output

    setattr(model, "generate", generate_with_write_back)  # noqa: B010  (an instance attribute)


def install_hooks(model: torch.nn.Module) -> None:
    """Attach the adapter to ``model`` (idempotent)."""
    if getattr(model, _INSTALLED, False):
        return
    model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    model.register_forward_hook(_post_forward, with_kwargs=True)
    _wrap_generate(model)
    setattr(model, _INSTALLED, True)
