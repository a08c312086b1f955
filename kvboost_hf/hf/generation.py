"""Stage 8 helpers for ``generate()``: a write-back logits processor, a streamer that timestamps tokens, and a
cancellation criterion."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class ChunkWriteBack(LogitsProcessor):
    """A pass-through logits processor that writes a reuse cache's completed chunks back as generation proceeds.

    ``model.generate(ids, past_key_values=cache, logits_processor=[ChunkWriteBack(cache)])``. It sees every step:
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
        elif self.cache.forwards > self._first_forward:
            self.cache.save(tail=False)
        return scores


class TokenTimer(BaseStreamer):
    """Records when each generated token becomes available and forwards it to ``on_token``.

    ``generate()`` first puts the prompt, then one tensor of new tokens (one per batch row) per step; assisted
    (speculative) decoding puts ``[1, n]``: the ``n`` tokens one verify step kept for its single row, which
    ``on_token`` receives one at a time. Moving a token to the CPU synchronises the device, so a timestamp is
    taken when the token really exists. ``first_token_time`` is a ``time.perf_counter()`` value, or None before
    the first token; ``first_step_tokens`` counts the tokens (per row) that arrived with it.
    """

    def __init__(self, on_token: Callable[[list[int]], None] | None = None) -> None:
        self.on_token = on_token
        self.first_token_time: float | None = None
        self.first_step_tokens = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        steps = value.reshape(-1, 1).tolist() if value.dim() == 2 else [value.reshape(-1).tolist()]
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
            self.first_step_tokens = len(steps)
        if self.on_token is not None:
            for tokens in steps:
                self.on_token(tokens)

    def end(self) -> None:
        return None


class FinishedCriteria(StoppingCriteria):
    """Stops every row as soon as ``finished()`` is true (checked after each step)."""

    def __init__(self, finished: Callable[[], bool]) -> None:
        self.finished = finished

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        stop = torch.full((input_ids.shape[0],), self.finished(), dtype=torch.bool, device=input_ids.device)
        return stop  # type: ignore[return-value]  # transformers annotates BoolTensor, returns plain bool tensors
