"""Stage 7: an optional adapter that lets ``generate()`` and ``forward()`` drive a reuse cache.

:class:`~kvboost_hf.hf.cache.ChunkReuseCache` and its prefiller do their work in explicit calls
(``cache.prefill()``, ``record()``, ``save()``; :func:`kvboost_hf.hf.prefill.forward` drives one forward
with them), so nothing of the library needs this adapter. It exists for
``model.generate(ids, cache=ChunkReuseCache(...))`` and ``model(...)``: installed once per model (a
``ChunkReuseCache`` installs it), removable with :func:`uninstall_hooks`, and inert for any call that is not
given such a cache:

* a forward pre-hook calls :func:`~kvboost_hf.hf.prefill.prepare_forward` (load what the store holds, feed only
  what is left);
* a forward hook calls ``record()`` with the tokens the forward computed;
* ``generate()`` of a model with the adapter, given a reuse cache, runs :func:`generate_with_write_back`: it refuses
  a prompt that does not extend what the cache holds (instead of silently attending to stale K/V), adds
  :class:`~kvboost_hf.hf.generation.ChunkWriteBack` to the logits processors (write-back as generation proceeds)
  and saves the unfinished last chunk when generation ends. :mod:`~kvboost_hf.hf.dispatch` routes such calls from
  ``GenerationMixin.generate``, so a model class whose own ``generate`` never calls it gets the forward hooks only
  (call ``cache.save()`` after its generation).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import LogitsProcessorList

from kvboost_hf.hf.generation import ChunkWriteBack
from kvboost_hf.hf.models import given_cache
from kvboost_hf.hf.prefill import prepare_forward, reuse_cache


@torch.compiler.disable  # host bookkeeping: a compiled __call__ (generate() with a static cache) runs it eagerly
def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    cache = reuse_cache(given_cache(kwargs))
    if cache is None:
        return None
    args, kwargs = as_keywords(type(module).forward, args, kwargs, bound=True)
    if kwargs.get("use_cache") is False:
        cache.reuse_enabled = False  # transformers then feeds whole sequences again: columns are not positions
    fed = kwargs.get("input_ids")
    if cache.prompt_forward_next or fed is None or fed.shape[1] > 1:  # a generation's first forward or a prompt's
        cache.check_model(module)  # (not per decode step)
        cache.check_intact()
        if fed is not None:
            cache.check_forward(fed, kwargs.get("attention_mask"), kwargs.get("position_ids"))
    continues = cache.prompt_in_progress and not cache.prompt_forward_next  # chunked prefill's next chunk
    return args, prepare_forward(cache, kwargs, report=cache.prompt_forward_next or continues, continues=continues)


@torch.compiler.disable
def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = reuse_cache(given_cache(kwargs))
    if cache is not None:
        cache.record(kwargs.get("input_ids"))


def drives_generate(kwargs: dict[str, Any]) -> bool:
    """Whether a ``generate()`` call with ``kwargs`` goes through :func:`generate_with_write_back`: it is given a
    reuse cache whose model has the adapter (:mod:`~kvboost_hf.hf.dispatch` asks, for every call)."""
    cache = reuse_cache(given_cache(kwargs))
    return cache is not None and getattr(cache, "model", None) in _ADAPTERS


def generate_with_write_back(
    model: torch.nn.Module, generate: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """Run ``generate(model, *args, **kwargs)`` (``GenerationMixin.generate``, given a reuse cache) with the
    adapter's write-back: refuse a cache built for another model and a prompt that does not extend what the cache
    holds, add :class:`~kvboost_hf.hf.generation.ChunkWriteBack` to the logits processors, and store the unfinished
    last chunk when generation ends (not after a draft round)."""
    cache: Any = given_cache(kwargs)
    cache.check_model(model)
    cache.check_intact()
    install_hooks(model)  # a copy of the cache's model (same digest) runs its forwards through the hooks too
    args, kwargs = as_keywords(generate, args, kwargs, bound=True)
    input_ids = kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(input_ids, torch.Tensor) and not input_ids.is_floating_point():
        cache.check_extends(input_ids, kwargs.get("attention_mask"))
    processors = LogitsProcessorList(kwargs.get("logits_processor") or [])
    if not any(isinstance(p, ChunkWriteBack) and p.cache is cache for p in processors):
        processors.append(ChunkWriteBack(cache))
    kwargs["logits_processor"] = processors
    cache.prompt_forward_next = cache.prompt_in_progress = True
    output = generate(model, *args, **kwargs)
    drafting = getattr(kwargs.get("generation_config"), "is_assistant", False)
    cache.save(tail=not drafting)  # a draft round is not the end of a generation
    return output


def as_keywords(
    function: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *, bound: bool = False
) -> tuple[tuple, dict[str, Any]]:
    """``args`` moved into ``kwargs`` under the names of ``function``'s parameters (a class's plain function when
    ``bound``: its first, ``self``, is skipped), so hooks read every argument by name. Left as they are when they
    do not bind (the call then raises its own error)."""
    if not args:
        return args, kwargs
    names = _positional_names(function)[1 if bound else 0 :]
    if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return args, kwargs
    return (), {**kwargs, **dict(zip(names, args, strict=False))}


@functools.lru_cache(maxsize=64)
def _positional_names(function: Callable[..., Any]) -> list[str]:
    """The names of ``function``'s parameters that a positional argument can fill, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds]


_ADAPTERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.utils.hooks.RemovableHandle]] = (
    weakref.WeakKeyDictionary()
)  # the models with the adapter, and the handles of their forward hooks


def install_hooks(model: torch.nn.Module) -> None:
    """Attach the adapter to ``model`` (once: a second call is a no-op). A copy of a model with the adapter
    (``copy.deepcopy``) carries copies of its hooks but no handles: they are replaced, never doubled."""
    if model in _ADAPTERS:
        return
    _drop_copied_hooks(model)
    _ADAPTERS[model] = [
        model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
        model.register_forward_hook(_post_forward, with_kwargs=True),
    ]


def _drop_copied_hooks(model: torch.nn.Module) -> None:
    """Remove the adapter's hooks that ``model`` holds without handles (copied with the module's hook dicts)."""
    for hooks, flags in (
        (model._forward_pre_hooks, (model._forward_pre_hooks_with_kwargs,)),
        (model._forward_hooks, (model._forward_hooks_with_kwargs, model._forward_hooks_always_called)),
    ):
        for key in [key for key, hook in hooks.items() if hook in (_pre_forward, _post_forward)]:
            del hooks[key]
            for flag in flags:
                flag.pop(key, None)


def uninstall_hooks(model: torch.nn.Module) -> bool:
    """Remove the adapter from ``model`` (its forward hooks and the ``generate`` wrapper); False when none was
    installed. Afterwards ``model.generate(cache=ChunkReuseCache(...))`` no longer loads or stores
    chunks (a new ``ChunkReuseCache`` installs the adapter again); explicit driving still works."""
    handles = _ADAPTERS.pop(model, None)
    if handles is None:
        return False
    for handle in handles:
        handle.remove()
    return True


def hooks_installed(model: torch.nn.Module) -> bool:
    """Whether the adapter is attached to ``model``."""
    return model in _ADAPTERS


@contextlib.contextmanager
def without_hooks(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with the adapter removed from ``model``, and put it back afterwards if it was there."""
    removed = uninstall_hooks(model)
    try:
        yield
    finally:
        if removed:
            install_hooks(model)
