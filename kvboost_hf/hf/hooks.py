"""Stage 7: how a :class:`~kvboost_hf.hf.cache.ChunkReuseCache` sees what ``generate()`` and ``forward()`` do.

Installed once per model and inert unless ``past_key_values`` is a cache that implements the hook protocol
(``before_forward``, ``after_forward``, ``check_extends``):

* a forward pre-hook lets the cache stitch stored K/V and cut ``input_ids``/``position_ids`` to the uncached
  tail before the model runs;
* a forward hook lets it record the computed tokens and write completed chunks back;
* a wrapper of ``prepare_inputs_for_generation`` (which receives the *full* sequence every step) lets it refuse
  a prompt that does not extend what it holds, instead of silently attending to stale K/V.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_INSTALLED = "_kvboost_hooks_installed"


def _reuse_cache(kwargs: dict[str, Any]) -> Any | None:
    cache = kwargs.get("past_key_values")
    return cache if hasattr(cache, "before_forward") and hasattr(cache, "after_forward") else None


def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    cache = _reuse_cache(kwargs)
    if cache is None:
        return None
    if args and "input_ids" not in kwargs:
        kwargs["input_ids"], args = args[0], args[1:]
    cache.before_forward(kwargs)
    return args, kwargs


def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _reuse_cache(kwargs)
    if cache is not None:
        cache.after_forward(kwargs)


def install_hooks(model: torch.nn.Module) -> None:
    """Attach the hooks to ``model`` (idempotent)."""
    if getattr(model, _INSTALLED, False):
        return
    model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    model.register_forward_hook(_post_forward, with_kwargs=True)
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is not None:

        @functools.wraps(prepare)
        def prepare_checked(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("past_key_values")
            if hasattr(cache, "check_extends") and input_ids is not None:
                cache.check_extends(input_ids)
            return prepare(input_ids, *args, **kwargs)

        model.prepare_inputs_for_generation = prepare_checked
    setattr(model, _INSTALLED, True)
