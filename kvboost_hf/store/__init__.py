"""Stage 3: where chunk K/V live. :class:`ChunkStore` (RAM, bounded in bytes) over optional lower tiers: disk
(:mod:`.disk`) and Redis (:mod:`.remote`), one :class:`~.base.StorageTier` interface; records are encoded with
checksums (:mod:`.codec`) and optionally KIVI-quantized (:mod:`.quantization`)."""

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store.chunk_store import ChunkStore

__all__ = ["ChunkKV", "ChunkStore"]
