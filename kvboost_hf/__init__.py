"""kvboost_hf: chunk-level K/V reuse across requests for Hugging Face Transformers.

Public API::

    from kvboost_hf import KVBoost, ChunkStore, ChunkReuseCache

    engine = KVBoost.from_pretrained()            # embedded SmolLM2-135M-Instruct
    result = engine.generate("Hello", max_new_tokens=32)
    result = engine.generate("Hello", sampling=SamplingConfig(temperature=0.7, top_k=40, seed=1))  # = the server

    cache = ChunkReuseCache(ChunkStore(), model)  # drop-in for model.generate(cache=...)

    engine = KVBoost.from_pretrained(name, streaming=LayerStreamingConfig(keep_first_k=4))  # larger than the GPU
    handle = enable_layer_streaming(model, LayerStreamingConfig())  # the same for a model you loaded yourself

    engine = KVBoost.from_pretrained(name, draft_model=draft_path, draft=DraftConfig(5))  # speculative decoding

Importing the package registers ``attn_implementation="kvboost"`` with transformers and routes a ``generate()``
given a ``ChunkReuseCache`` to its write-back (:mod:`kvboost_hf.hf.dispatch`): at once where transformers' model code
(``transformers.modeling_utils``, which every model and ``from_pretrained`` import) is loaded, otherwise the moment
it loads. The names that need transformers or accelerate (the engine, the drop-in cache, sampling,
speculative decoding, layer streaming) are imported on first use (PEP 562), so ``import kvboost_hf`` and its store
modules cost the import of torch, not transformers' model code as well (about 3.5 s of CPU with torchao, which a
process using only the store, such as a disk-tier worker, or a grammar compile process does not pay).
"""

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import GenerationMode, RecomputeStrategy, RepairConfig
from kvboost_hf.core.errors import KVBoostError
from kvboost_hf.results import CorrectnessReport, GenerationResult, WarmResult
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

if TYPE_CHECKING:
    from kvboost_hf.engine import InferenceEngine
    from kvboost_hf.hf.cache import ChunkReuseCache
    from kvboost_hf.hf.chat_segments import DocumentBoundaries
    from kvboost_hf.hf.generation import ChunkWriteBack
    from kvboost_hf.hf.hooks import uninstall_hooks, without_hooks
    from kvboost_hf.hf.models import UnsupportedModelError
    from kvboost_hf.hf.sampling import SamplingConfig
    from kvboost_hf.hf.sampling import SamplingParams as SamplingParams
    from kvboost_hf.hf.speculative import DraftConfig, Speculation
    from kvboost_hf.hf.speculative import DraftSettings as DraftSettings
    from kvboost_hf.offload import LayerStreamingConfig, disable_layer_streaming, enable_layer_streaming
    from kvboost_hf.offload.settings import LayerStreaming as LayerStreaming

    KVBoost = InferenceEngine

#: Public names whose modules import transformers or accelerate: name -> (module, attribute), imported on first use.
_ON_FIRST_USE = {
    "ChunkReuseCache": ("kvboost_hf.hf.cache", "ChunkReuseCache"),
    "ChunkWriteBack": ("kvboost_hf.hf.generation", "ChunkWriteBack"),
    "DocumentBoundaries": ("kvboost_hf.hf.chat_segments", "DocumentBoundaries"),
    "DraftConfig": ("kvboost_hf.hf.speculative", "DraftConfig"),
    "DraftSettings": ("kvboost_hf.hf.speculative", "DraftSettings"),
    "InferenceEngine": ("kvboost_hf.engine", "InferenceEngine"),
    "KVBoost": ("kvboost_hf.engine", "InferenceEngine"),
    "LayerStreaming": ("kvboost_hf.offload.settings", "LayerStreaming"),
    "LayerStreamingConfig": ("kvboost_hf.offload", "LayerStreamingConfig"),
    "SamplingConfig": ("kvboost_hf.hf.sampling", "SamplingConfig"),
    "SamplingParams": ("kvboost_hf.hf.sampling", "SamplingParams"),
    "Speculation": ("kvboost_hf.hf.speculative", "Speculation"),
    "UnsupportedModelError": ("kvboost_hf.hf.models", "UnsupportedModelError"),
    "disable_layer_streaming": ("kvboost_hf.offload", "disable_layer_streaming"),
    "enable_layer_streaming": ("kvboost_hf.offload", "enable_layer_streaming"),
    "uninstall_hooks": ("kvboost_hf.hf.hooks", "uninstall_hooks"),
    "without_hooks": ("kvboost_hf.hf.hooks", "without_hooks"),
}

# loggers of optional dependencies that transformers' model code imports and that log at import time: torchao (with
# the ``awq`` extra) logs each compiled extension it cannot load, torch logs the deprecation of torchao's enum
# registrations. Neither concerns this package: they are quieted while that code loads (:func:`_quiet_imports`).
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")
_TRANSFORMERS_MODELS = "transformers.modeling_utils"  # defines AttentionInterface; every model imports it
# importing these registers "kvboost" and routes generate() given a reuse cache to the drop-in adapter
_ON_MODEL_CODE = ("kvboost_hf.hf.attention", "kvboost_hf.hf.dispatch")


@contextmanager
def _quiet_imports() -> Iterator[None]:
    """Raise :data:`_NOISY_IMPORT_LOGGERS` to ERROR while the block runs, then restore their levels."""
    loggers = [logging.getLogger(name) for name in _NOISY_IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def __getattr__(name: str) -> Any:
    """The names of :data:`_ON_FIRST_USE`, imported (quietly) on first access and kept in the module after it."""
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _ON_FIRST_USE[name]
    with _quiet_imports():
        value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_FIRST_USE})


def _import_integrations() -> None:
    """Import :data:`_ON_MODEL_CODE` (where the attention module's import is what loads the model code, that module
    is half-imported here and registers when it finishes)."""
    for module in _ON_MODEL_CODE:
        importlib.import_module(module)


class _RegisterAttention(importlib.abc.Loader):
    """Loads transformers' model code with its own loader (import-time noise quieted), then
    :func:`_import_integrations`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _quiet_imports():
            self._loader.exec_module(module)
            _import_integrations()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the file's own loader
        if name == "_loader":  # a copy made without __init__: no loader to ask (and no recursion)
            raise AttributeError(name)
        return getattr(self._loader, name)


class _OnTransformersModels(importlib.abc.MetaPathFinder):
    """Finds nothing itself; the first import of :data:`_TRANSFORMERS_MODELS` gets the spec the other finders give,
    loaded by :class:`_RegisterAttention`. Stays on ``sys.meta_path`` after (removing it could make an import in
    another thread skip a finder) as one string comparison per import."""

    def __init__(self) -> None:
        self._used = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _TRANSFORMERS_MODELS or self._used:
            return None
        self._used = True  # before the search below, which asks this finder too
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAttention(spec.loader)
        return spec


if _TRANSFORMERS_MODELS in sys.modules:
    _import_integrations()
else:
    sys.meta_path.insert(0, _OnTransformersModels())

# The user's surface: what a program using the engine, the drop-in cache or layer streaming writes. Internals (the
# decode loop, reuse planning, batch policy, tiers, stats records) stay importable from their own modules.
# Settings classes end in ``Config``. SamplingParams, DraftSettings and LayerStreaming, the earlier names of
# SamplingConfig, DraftConfig and LayerStreamingConfig (README examples use them), are importable, not listed.
__all__ = [
    "ChunkReuseCache",
    "ChunkStore",
    "ChunkWriteBack",
    "ChunkingConfig",
    "CorrectnessReport",
    "DocumentBoundaries",
    "DraftConfig",
    "GenerationMode",
    "GenerationResult",
    "InferenceEngine",
    "KVBoost",
    "KVBoostError",
    "LayerStreamingConfig",
    "RecomputeStrategy",
    "RepairConfig",
    "SamplingConfig",
    "Speculation",
    "StoreConfig",
    "UnsupportedModelError",
    "WarmResult",
    "disable_layer_streaming",
    "enable_layer_streaming",
    "uninstall_hooks",
    "without_hooks",
]
__version__ = "0.1.0"
