"""Stage 3: where chunk K/V live. :class:`ChunkStore` (RAM, bounded in bytes: :mod:`.ram`) over optional lower
tiers: disk (:mod:`.disk`), Redis (:mod:`.remote`) or any :class:`~.base.StorageTier`, set up by a
:class:`~.config.StoreConfig`; records are encoded with
checksums (:mod:`.codec`) and optionally KIVI-quantized (:mod:`.quantization`); CUDA K/V reach pinned RAM by
asynchronous copies (:mod:`.landing`)."""

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.base import StorageTier
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig

__all__ = ["ChunkKV", "ChunkStore", "StorageTier", "StoreConfig"]
