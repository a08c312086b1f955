"""``GenerationMixin.generate`` hands a call given a reuse cache to the drop-in adapter (:mod:`kvboost_hf.hf.hooks`).

Why on the class, from the moment transformers' model code loads (``import kvboost_hf`` arranges that importing this
module follows, as it does for ``"kvboost"``): in ``model.generate(ids, cache=ChunkReuseCache(store, model))`` Python
looks ``model.generate`` up before it evaluates the arguments, so a wrapper that the cache's constructor set on the
model instance missed the first such call of a process, and with it that generation's write-back (its prompt's
chunks and unfinished last chunk were never stored). Any other call costs one dictionary lookup.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from transformers import GenerationMixin

_HOOKS = "kvboost_hf.hf.hooks"  # imported by the reuse cache's module: not imported, no reuse cache exists
_MARK = "_kvboost_dispatch"


def install_generate_dispatch() -> None:
    """Put the dispatcher on ``GenerationMixin.generate`` (once: a second call, or a reload, is a no-op)."""
    original = GenerationMixin.generate
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = sys.modules.get(_HOOKS)
        if hooks is not None and hooks.drives_generate(kwargs):
            return hooks.generate_with_write_back(self, original, args, kwargs)
        return original(self, *args, **kwargs)

    setattr(generate, _MARK, True)
    GenerationMixin.generate = generate


install_generate_dispatch()  # importing this module installs it (kvboost_hf's import arranges that it is imported)
