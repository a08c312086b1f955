"""Stages 1-2 of the data path and the types every stage shares: token ids -> chunks (:mod:`.chunking`) -> keys
(:mod:`.keys`), the unit of reuse (:class:`~.chunk_kv.ChunkKV`) and the settings (:mod:`.config`).

Nothing here imports from the rest of the package."""
