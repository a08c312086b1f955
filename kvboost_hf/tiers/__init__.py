"""Storage tiers of the chunk store: shared types in :mod:`.base`, RAM in :mod:`kvboost_hf.store`,
:mod:`.disk` (mmap slot file) and :mod:`.remote` (Redis)."""

from kvboost_hf.tiers.base import ChunkKV, FrequencyRecencyOrder, StorageTier, StoredChunk

__all__ = ["ChunkKV", "FrequencyRecencyOrder", "StorageTier", "StoredChunk"]
