"""Which requests share a decode loop: one policy for ``KVBoost.generate_many`` and the server's worker.

A batch is one :class:`~kvboost_hf.hf.decode.DecodeLoop`: its rows decode together, one forward per step. The rules,
in order:

1. rows of one batch share one cache namespace: the same ``cache_salt``;
2. any requests of one namespace may share a batch (``generate_many`` orders them by prompt length, so a batch pads
   little); prefix hits and shared prefixes work for every row of a batch;
3. some prompts are *prefilled* alone (:meth:`BatchPolicy.prefill_alone`), then decode with their batch from the
   first step: the decode loop prefills each of them in a cache of its own and joins it to the others (the ``n``
   choices of one prompt count as one row: the loop prefills them once). They are

   * segment prompts (documents given as segments, looked up by content key so they stitch at any position): a
     cache is built with one prompt's segment starts, which shape its chunks and keys; each row keeps its own once
     joined (its ledger carries them), so its chunks are written back under the keys its own cache would use;
   * with ``mode="chunk_kv_reuse"``, prompts for which the store holds non-prefix hits (chunks at or after the first
     missed chunk, stored under prefix or content key; see :func:`~kvboost_hf.reuse.plan.has_nonprefix_hits`):
     the cache stitches and repairs those for one row at a time.

A prompt without segments is classified when its batch is prefilled (two ``contains_many`` store calls at most).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.core.keys import KeySpace
from kvboost_hf.reuse.plan import ChunkSource, has_nonprefix_hits


@dataclass(frozen=True)
class BatchKey:
    """Requests with equal keys may share a batch (and join a running one)."""

    cache_salt: str | None


class BatchPolicy:
    """The batching rules above for one store, key space and generation mode.

    Args:
        store: the chunk store the caches read.
        key_space: the caches' :class:`~kvboost_hf.core.keys.KeySpace` (each tenant's namespace, the chunking).
        mode: the generation mode of the batches.
    """

    def __init__(self, store: ChunkSource, key_space: KeySpace, mode: GenerationMode | str) -> None:
        self.store = store
        self.key_space = key_space
        self.mode = GenerationMode(mode)

    def key(self, cache_salt: str | None) -> BatchKey:
        """The batch key of a request of tenant ``cache_salt``."""
        return BatchKey(cache_salt)

    def prefill_alone(
        self, prompt_ids: Sequence[int], cache_salt: str | None, segment_starts: Sequence[int] = ()
    ) -> bool:
        """Whether the prompt is prefilled in a cache of its own (rule 3): with reuse on, when it has segment starts;
        with ``mode="chunk_kv_reuse"``, also when the store holds non-prefix hits for it (reads the store)."""
        if self.mode is GenerationMode.BASELINE:
            return False  # plain K/V: no cache to build per prompt
        if segment_starts:
            return True
        if self.mode is not GenerationMode.CHUNK_KV_REUSE:
            return False
        namespace = self.key_space.namespace(cache_salt)
        return has_nonprefix_hits(self.store, prompt_ids, namespace=namespace, chunking=self.key_space.chunking)

    def batches(self, prompts: Sequence[Sequence[int]], max_batch_size: int) -> list[list[int]]:
        """Indices of ``prompts`` (one tenant's) grouped into batches of at most ``max_batch_size``, by prompt
        length."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
        return [order[lo : lo + max_batch_size] for lo in range(0, len(order), max_batch_size)]
