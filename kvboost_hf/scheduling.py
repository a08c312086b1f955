"""Which requests share a decode loop: one policy for ``KVBoost.generate_many`` and the server's worker.

A batch is one :class:`~kvboost_hf.hf.decode.DecodeLoop` on one cache. The rules, in order:

1. rows of one batch share one cache namespace: the same ``cache_salt``;
2. a segment prompt runs in a batch of its own (its segment starts belong to one cache);
3. any other requests of one namespace may share a batch (``generate_many`` orders them by prompt length, so a
   batch pads little); prefix hits and shared prefixes work for every row of a batch. With
   ``mode="chunk_kv_reuse"`` a prompt for which the store holds non-prefix hits (chunks at or after its first
   missed chunk, stored under prefix or content key; see :func:`~kvboost_hf.reuse.plan.has_nonprefix_hits`) is
   *prefilled* alone (:meth:`BatchPolicy.prefill_alone`): the cache stitches and repairs those for one row at a
   time, so the decode loop prefills it in a batch of its own and joins it to the others for decoding (the ``n``
   choices of one prompt count as one row: the loop prefills them once).

A request is classified when it arrives and again when its batch is prefilled (two ``contains_many`` store calls
at most each time).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import GenerationMode
from kvboost_hf.reuse.plan import ChunkSource, has_nonprefix_hits

_TICKETS = itertools.count()


@dataclass(frozen=True)
class BatchKey:
    """Requests with equal keys may share a batch. ``alone`` is a unique ticket for a request that runs alone."""

    cache_salt: str | None
    alone: int | None = None

    @property
    def shares(self) -> bool:
        """Whether other requests may join a batch of this key."""
        return self.alone is None


class BatchPolicy:
    """The batching rules above for one store, chunking and generation mode.

    Args:
        store: the chunk store the caches read.
        namespace: cache_salt -> the cache namespace of that tenant (see :func:`~kvboost_hf.core.keys.make_namespace`).
        chunking: the caches' chunking.
        mode: the generation mode of the batches.
    """

    def __init__(
        self,
        store: ChunkSource,
        namespace: Callable[[str | None], str],
        chunking: ChunkingConfig,
        mode: GenerationMode | str,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.chunking = chunking
        self.mode = GenerationMode(mode)

    def key(self, prompt_ids: Sequence[int], cache_salt: str | None, segment_starts: Sequence[int] = ()) -> BatchKey:
        """The batch key of a request: one of its own for a segment prompt."""
        return BatchKey(cache_salt, next(_TICKETS)) if segment_starts else BatchKey(cache_salt)

    def prefill_alone(self, prompt_ids: Sequence[int], cache_salt: str | None) -> bool:
        """Whether the prompt's reuse needs a repair, made for one row at a time: with ``mode="chunk_kv_reuse"``,
        the store holds non-prefix hits for it (reads the store)."""
        if self.mode is not GenerationMode.CHUNK_KV_REUSE:
            return False
        return has_nonprefix_hits(self.store, prompt_ids, namespace=self.namespace(cache_salt), chunking=self.chunking)

    def batches(
        self,
        prompts: Sequence[Sequence[int]],
        segment_starts: Sequence[Sequence[int]],
        cache_salt: str | None,
        max_batch_size: int,
    ) -> list[list[int]]:
        """Indices of ``prompts`` grouped into batches of at most ``max_batch_size``: requests that run alone first
        (input order), then the others by prompt length."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        alone: list[list[int]] = []
        shared: list[int] = []
        for index, (ids, starts) in enumerate(zip(prompts, segment_starts, strict=True)):
            if self.key(ids, cache_salt, starts).shares:
                shared.append(index)
            else:
                alone.append([index])
        shared.sort(key=lambda index: len(prompts[index]))
        return alone + [shared[lo : lo + max_batch_size] for lo in range(0, len(shared), max_batch_size)]
