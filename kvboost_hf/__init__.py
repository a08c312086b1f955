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

Importing the package registers ``attn_implementation="kvboost"`` with transformers.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager

# loggers of optional dependencies that transformers imports with us and that log at import time: torchao (with the
# ``awq`` extra) logs each compiled extension it cannot load, torch logs the deprecation of torchao's enum
# registrations. Neither concerns this package, so ``import kvboost_hf`` prints nothing.
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


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


with _quiet_imports():
    from kvboost_hf.core.chunking import ChunkingConfig
    from kvboost_hf.core.config import GenerationMode, RecomputeStrategy, RepairConfig
    from kvboost_hf.core.errors import KVBoostError
    from kvboost_hf.engine import InferenceEngine
    from kvboost_hf.hf.attention import register_kvboost_attention
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
    from kvboost_hf.results import CorrectnessReport, GenerationResult, WarmResult
    from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

KVBoost = InferenceEngine
register_kvboost_attention()

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
