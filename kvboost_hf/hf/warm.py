"""The warm path: compute and store a text's K/V ahead of the requests that will contain it (the engine's
``warm`` and ``warm_documents``, the server's ``/v1/warm``).

Invariants: one target forward per text (two for a string its tokenizer adds special tokens to: see
:meth:`PromptWarmer.warm`), through a fresh chunk-reuse cache built without hooks and run under the engine's lock;
what is stored is what a prefill of the same tokens stores (by prefix key, and by content key for a
text with segments, its last partial chunk included), so later prompts hit it exactly or, placed elsewhere as a
segment, approximately (repaired).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.config import GenerationMode
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.prompts import Prompt, PromptEncoder
from kvboost_hf.results import WarmResult

#: ``(mode, cache_salt, segment_starts) -> a fresh chunk-reuse cache`` (no hooks) on the engine's store and model.
NewCache = Callable[[GenerationMode, str | None, Sequence[int]], ChunkReuseCache]


class PromptWarmer:
    """Stores the K/V of texts for one model.

    Args:
        model: the causal LM that computes them.
        chunking: how the caches cut texts (``new_cache``'s).
        prompts: renders and tokenizes the texts.
        new_cache: builds each text's cache (on the store they go to: its ``puts`` counter gives each result's
            ``chunks_stored``).
        lock: held while the model runs (one forward at a time).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        chunking: ChunkingConfig,
        prompts: PromptEncoder,
        new_cache: NewCache,
        lock: contextlib.AbstractContextManager,
    ) -> None:
        self.model = model
        self.chunking = chunking
        self.prompts = prompts
        self.new_cache = new_cache
        self.lock = lock

    def warm(self, text: Prompt, *, cache_salt: str | None = None) -> WarmResult:
        """Compute and store the K/V of ``text`` so that later prompts containing it hit.

        A string is stored as one segment: by prefix key (prompts starting with it hit exactly) and by content
        key, its last partial chunk included (prompts holding it at any offset, given as a segment, hit it and
        repair it). A list of segments is stored the same way, segment by segment (``[header, document]`` stores
        the document as computed after the header). Chat messages are rendered without a generation prompt and
        stored by prefix key, and their marked content parts (see :meth:`PromptEncoder.encode_segments`) by
        content key too. A string its tokenizer adds special tokens to (a BOS) is stored a second time as
        tokenized without them (as :meth:`warm_documents` does), which is how a prompt's later segments are
        tokenized: its content chunks then line up with the text placed at any offset, not shifted by the BOS.
        ``chunks_stored`` counts both.
        """
        ids, starts = self.prompts.encode_segments(text, add_generation_prompt=False)
        if starts or isinstance(text, str):  # the last segment ends here: its partial last chunk is stored too
            starts = sorted({*starts, 0, len(ids)})
        result = self._store(ids, starts, cache_salt)
        bare = self.prompts.tokenize(text, add_special_tokens=False, allow_empty=True) if isinstance(text, str) else []
        if bare and bare != ids:
            as_segment = self._store(bare, [0, len(bare)], cache_salt)
            result = dataclasses.replace(result, chunks_stored=result.chunks_stored + as_segment.chunks_stored)
        return result

    def warm_documents(self, documents: Sequence[str], *, cache_salt: str | None = None) -> list[WarmResult]:
        """Store each document alone, as it appears inside a chat prompt (tokenized without special tokens), by
        prefix and content key, its last partial chunk included: a chat prompt that marks it as a document (a
        content part, see :mod:`kvboost_hf.hf.chat_segments`) hits it at any position, in any order."""
        results = []
        for document in documents:
            ids = self.prompts.tokenize(document, add_special_tokens=False)
            results.append(self._store(ids, [0, len(ids)], cache_salt))
        return results

    def _store(self, ids: list[int], segment_starts: list[int], cache_salt: str | None) -> WarmResult:
        """Compute the K/V of ``ids`` and store them (by content key too when there are segments)."""
        self.prompts.check_length(len(ids), 1)
        mode = GenerationMode.CHUNK_KV_REUSE if segment_starts else GenerationMode.PREFIX_CACHE
        cache = self.new_cache(mode, cache_salt, segment_starts)
        puts_before = cache.store.stats()["puts"]
        with self.lock:
            forward(self.model, cache, input_ids=torch.tensor([ids], device=self.model.device), logits_to_keep=1)
            cache.save(tail=True)
        chunking = self.chunking
        spans = chunk_spans(ids, chunking, segment_starts=cache.segment_starts)
        covered = spans[-1][1] if spans else 0
        tail = len(ids) - covered
        partial = len(ids) % chunking.chunk_size if chunking.method == "fixed" else tail
        warning = None
        if tail:
            warning = (
                f"the last {tail} of {len(ids)} tokens do not fill a chunk of {chunking.chunk_size}: they are stored "
                "as an unfinished chunk, which a later prompt hits where it continues this text with them"
            )
        elif partial:
            warning = (
                f"the last chunk holds {partial} tokens: it hits only where this text ends a segment; prompts that "
                "continue it in the same segment recompute those tokens"
            )
        return WarmResult(
            chunks_stored=cache.store.stats()["puts"] - puts_before,
            token_count=len(ids),
            chunk_size=chunking.chunk_size,
            chunk_boundary_aligned=partial == 0,
            partial_tail_tokens=partial,
            alignment_warning=warning,
        )
