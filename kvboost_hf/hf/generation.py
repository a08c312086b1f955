"""Stage 9 helper for ``generate()``: a logits processor that writes completed chunks back as generation proceeds."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor


class ChunkWriteBack(LogitsProcessor):
    """A pass-through logits processor that writes a reuse cache's completed chunks back as generation proceeds.

    ``model.generate(ids, cache=cache, logits_processor=[ChunkWriteBack(cache)])``. It sees every step:
    from the second forward on it calls ``cache.save(tail=False)`` (so the prompt's chunks are written after the
    first token, never inside time to first token). Scores are returned unchanged. When generation ends, the
    cache's ``generate`` wrapper stores the unfinished last chunk (``cache.save(tail=True)``); without the
    wrapper, call that yourself. The wrapper adds this processor itself when none is given.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self._first_forward: int | None = None  # the cache's forward count at the first step of this generation

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._first_forward is None:
            self._first_forward = self.cache.forwards
            self.cache.prompt_in_progress = False  # the prompt's forwards (every chunk of a chunked prefill) ran
        elif self.cache.forwards > self._first_forward:
            self.cache.save(tail=False)
        return scores
