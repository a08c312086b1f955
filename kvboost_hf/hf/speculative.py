"""Speculative decoding with a resident draft: the loop's :class:`Drafter`, and :class:`Speculation` for
transformers' own assisted generation.

Inside :class:`~kvboost_hf.hf.decode.DecodeLoop` (the engine's and the server's one loop), a :class:`Drafter` proposes
``g`` tokens per running row with greedy draft forwards; the target verifies every row's proposals in one batched
forward over ``g + 1`` positions; each row keeps its proposals up to the first one that differs from the token the
row itself chooses at that position (its processors, then argmax or a draw from its own seeded generator), plus that
chosen token. A draft therefore never changes a row's tokens: greedy and seeded sampled rows yield exactly what they
yield without a draft (the draws are the same draws), only in fewer target forwards. Rejected columns are dropped
from both caches row by row (:meth:`~kvboost_hf.hf.cache.ChunkReuseCache.drop_row_tails`).

For users of ``model.generate(assistant_model=draft)`` (transformers' assisted generation, batch size 1),
:class:`Speculation` wraps one call: it sets the draft schedule explicitly from :class:`DraftSettings`, gives the
draft a chunk-reuse cache, and counts target forwards and proposals::

    with Speculation(model, draft, DraftSettings(num_draft_tokens=5), lambda: ChunkReuseCache(store, draft)) as s:
        model.generate(ids, past_key_values=ChunkReuseCache(store, model), **s.generate_kwargs(), ...)
    s.stats.target_forwards
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.probe import truncated_depth

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "heuristic", "heuristic_transient")
_SCHEDULE_FIELDS = ("num_assistant_tokens", "assistant_confidence_threshold", "num_assistant_tokens_schedule")
_WRAPPED = "_kvboost_draft_wrapped"


@dataclass(frozen=True)
class DraftSettings:
    """How the draft proposes.

    Args:
        num_draft_tokens: tokens proposed per round (``g``; fixed under the ``"constant"`` schedule).
        confidence_threshold: (:class:`Speculation` only) the draft stops a round early when its top probability
            falls below this (0: never).
        schedule: (:class:`Speculation` only) transformers' ``num_assistant_tokens_schedule``; ``"heuristic"``
            grows ``g`` by 2 after a fully accepted round and shrinks it by 1 otherwise (and keeps it across calls).
            The decode loop's :class:`Drafter` proposes ``num_draft_tokens`` every round.
        early_exit_layers: when set, the draft is the target's own first ``early_exit_layers`` layers followed by
            its head (transformers' ``assistant_early_exit``) and no draft model is needed.
    """

    num_draft_tokens: int = 5
    confidence_threshold: float = 0.0
    schedule: str = "constant"
    early_exit_layers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {self.confidence_threshold!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.early_exit_layers is not None and (
            not isinstance(self.early_exit_layers, int) or self.early_exit_layers < 1
        ):
            raise ValueError(f"early_exit_layers must be a positive integer, got {self.early_exit_layers!r}")

    def check(self, target: PreTrainedModel, draft: PreTrainedModel | None) -> None:
        """Raise ValueError when these settings cannot draft for ``target`` with ``draft`` (a model or None)."""
        exit_layers = self.early_exit_layers
        if exit_layers is None:
            return
        if draft is not None:
            raise ValueError("give either a draft model or early_exit_layers, not both")
        layers = target.config.get_text_config(decoder=True).num_hidden_layers
        if exit_layers >= layers:
            raise ValueError(f"early_exit_layers must be below the target's {layers} layers, got {exit_layers}")

    def generation_fields(self) -> dict[str, Any]:
        """The assistant ``generation_config`` fields that fix this schedule."""
        values = (self.num_draft_tokens, self.confidence_threshold, self.schedule)
        return dict(zip(_SCHEDULE_FIELDS, values, strict=True))


@dataclass
class SpeculationStats:
    """Counters of one ``generate()`` call (tokens and forwards).

    ``target_forwards`` counts completed forwards of the target (prefill included; in assisted decoding one per
    verify round). ``draft_cached_tokens`` is how many prompt tokens the draft's first forward loaded from the
    store (None when the draft cache is not a chunk-reuse cache).
    """

    target_forwards: int = 0
    draft_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_cached_tokens: int | None = None
    round_starts: list[int] = field(default_factory=list)  # sequence length when each draft round began
    round_proposed: list[int] = field(default_factory=list)  # tokens proposed in each draft round

    def accepted(self, new_tokens: int) -> int:
        """Draft tokens kept among ``new_tokens`` generated: every verify forward adds exactly one target token."""
        return max(0, new_tokens - self.target_forwards) if self.draft_rounds else 0

    def position_acceptance(self, final_length: int) -> float | None:
        """Estimated probability that a draft token is accepted given that the ones before it were: accepted /
        (accepted + rounds ended by a rejection), with ``final_length`` the sequence length after generation.

        This is the ``a`` of the i.i.d. model in which a verify forward yields ``(1 - a^(g+1)) / (1 - a)`` tokens;
        it is larger than accepted / proposed, which also counts the proposals after a rejection.
        """
        if not self.draft_rounds:
            return None
        # a verify forward without a draft round (one token left) may follow the last round
        ends = [*self.round_starts[1:], final_length - (self.target_forwards - self.draft_rounds)]
        kept = [end - start - 1 for start, end in zip(self.round_starts, ends, strict=True)]
        rejected = sum(1 for k, g in zip(kept, self.round_proposed, strict=True) if k < g)
        return sum(kept) / max(sum(kept) + rejected, 1)


_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, Speculation] = weakref.WeakKeyDictionary()


def _install_draft_wrapper(model: torch.nn.Module) -> None:
    """Route ``model.generate`` calls made *as an assistant* through the active :class:`Speculation` (idempotent).

    Calls without ``generation_config.is_assistant`` (the user's own calls) or with no active speculation pass
    through unchanged.
    """
    if getattr(model, _WRAPPED, False):
        return
    original: Callable[..., Any] = model.generate  # type: ignore[assignment]

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        session = _ACTIVE.get(model)
        if session is None or not getattr(kwargs.get("generation_config"), "is_assistant", False):
            return original(*args, **kwargs)
        return session.run_draft(original, args, kwargs)

    vars(model)["generate"] = generate  # an instance attribute shadowing the class's method
    setattr(model, _WRAPPED, True)


class Speculation:
    """Context manager around one target ``generate()`` call: draft schedule, draft cache and counters.

    Args:
        target: the model whose ``generate`` is called.
        draft: a resident draft sharing the target's tokenizer, or None (then only target forwards are counted,
            unless ``settings.early_exit_layers`` makes the target its own draft).
        settings: the draft schedule.
        draft_cache: builds the draft's cache for this call (None: transformers' ``DynamicCache``). Not used
            with an early-exit draft (its cache holds only the first layers).

    A model can serve as the assistant of one active speculation at a time.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        settings: DraftSettings | None = None,
        draft_cache: Callable[[], Cache] | None = None,
    ) -> None:
        self.target = target
        self.settings = settings or DraftSettings()
        self.settings.check(target, draft)
        early_exit = self.settings.early_exit_layers is not None
        self.draft = draft
        self.assistant = target if early_exit else draft
        self.draft_cache = None if early_exit else draft_cache
        self.stats = SpeculationStats()
        self._drafting = False
        self._saved: dict[str, Any] = {}
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the target's ``generate()`` that enable the draft (empty without one)."""
        if self.settings.early_exit_layers is not None:
            return {"assistant_early_exit": self.settings.early_exit_layers}
        return {"assistant_model": self.draft} if self.draft is not None else {}

    def __enter__(self) -> Speculation:
        assistant = self.assistant
        if assistant is not None:
            if assistant in _ACTIVE:
                raise RuntimeError("this draft model is already drafting for another generate() call")
            _install_draft_wrapper(assistant)
            config = assistant.generation_config
            self._saved = {name: getattr(config, name, None) for name in _SCHEDULE_FIELDS}
            for name, value in self.settings.generation_fields().items():
                setattr(config, name, value)
            _ACTIVE[assistant] = self
        self._hook = self.target.register_forward_hook(self._count_forward)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.stats.draft_rounds:
            logger.debug(
                "speculation: %d target forwards, %d draft rounds, %d tokens proposed",
                self.stats.target_forwards,
                self.stats.draft_rounds,
                self.stats.draft_tokens_proposed,
            )
        assistant = self.assistant
        if assistant is not None and _ACTIVE.get(assistant) is self:
            del _ACTIVE[assistant]
            for name, value in self._saved.items():
                setattr(assistant.generation_config, name, value)

    def _count_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._drafting:
            self.stats.target_forwards += 1

    def run_draft(self, generate: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run one draft round (called by the assistant's wrapped ``generate``): give the draft its cache on the
        first round, and count the proposed tokens."""
        input_ids: torch.Tensor = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if kwargs.get("attention_mask") is None:
            # The target's generate() drops an all-ones mask; without one the draft would infer a mask from pad
            # token ids *inside* the prompt (chat prompts often hold the pad/EOS id) and attend to holes.
            kwargs["attention_mask"] = torch.ones_like(input_ids)
        cache = None
        if self.draft_cache is not None and kwargs.get("past_key_values") is None:
            cache = kwargs["past_key_values"] = self.draft_cache()
        self._drafting = True
        try:
            output = generate(*args, **kwargs)
        finally:
            self._drafting = False
        proposed = output.sequences.shape[1] - input_ids.shape[1]
        self.stats.draft_rounds += 1
        self.stats.draft_tokens_proposed += proposed
        self.stats.round_starts.append(input_ids.shape[1])
        self.stats.round_proposed.append(proposed)
        reuse = getattr(cache, "last_reuse", None)
        if reuse:
            self.stats.draft_cached_tokens = reuse[0].cached_tokens
        return output


class _HasModel(Protocol):
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


DraftSource: TypeAlias = str | os.PathLike | PreTrainedModel | _HasModel


def resolve_draft(
    draft: DraftSource,
    target: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    load: Callable[[str | os.PathLike], tuple[PreTrainedModel, PreTrainedTokenizerBase]],
) -> PreTrainedModel:
    """The draft model for ``draft`` (a path or hub name, loaded with ``load``; a model; or an object with
    ``.model`` and ``.tokenizer`` such as an engine). Raises when its vocabulary cannot be the target's."""
    tokenizer = None
    if isinstance(draft, (str, os.PathLike)):
        model, tokenizer = load(draft)
    elif isinstance(draft, PreTrainedModel):
        model = draft
    elif isinstance(getattr(draft, "model", None), PreTrainedModel):
        model, tokenizer = draft.model, getattr(draft, "tokenizer", None)
    else:
        raise TypeError(f"draft_model must be a path, a PreTrainedModel or an engine, got {type(draft).__name__}")
    if tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("the draft's tokenizer differs from the target's: speculative decoding needs one vocabulary")
    draft_vocab = model.config.get_text_config(decoder=True).vocab_size
    target_vocab = target.config.get_text_config(decoder=True).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft's vocabulary has {draft_vocab} entries, the target's {target_vocab}")
    return model.eval()


class Drafter:
    """The draft side of speculative decoding in :class:`~kvboost_hf.hf.decode.DecodeLoop`.

    Args:
        model: the resident draft (sharing the target's vocabulary), or the target itself when
            ``settings.early_exit_layers`` is set (the draft is then its first layers and its head).
        settings: ``num_draft_tokens`` proposed per round; ``early_exit_layers``.
        new_cache: builds the draft's cache (e.g. a chunk-reuse cache on the target's store, under the draft's own
            namespace); None = a ``DynamicCache``.

    Invariant: between rounds, :attr:`cache` holds exactly the target cache's columns (the same left-padded layout,
    one column per token fed to the target), so the loop's attention mask and positions serve both. ``forwards``
    counts draft forwards; ``cached_tokens`` is what the draft's prefill loaded per row.
    """

    def __init__(
        self, model: PreTrainedModel, settings: DraftSettings, new_cache: Callable[[], Cache] | None = None
    ) -> None:
        self.model = model
        self.settings = settings
        self.new_cache = new_cache
        self.cache: Cache | None = None
        self.forwards = 0
        self.cached_tokens: list[int] = []

    def spawn(self) -> Drafter:
        """A drafter with the same model and settings and no state (for rows joining a running loop)."""
        return Drafter(self.model, self.settings, self.new_cache)

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Run the draft over the left-padded prompts on a fresh cache."""
        self.cache = self.new_cache() if self.new_cache is not None else DynamicCache()
        self.forward(input_ids, mask, position_ids)
        reuse = getattr(self.cache, "last_reuse", None) or []
        self.cached_tokens = [entry.cached_tokens for entry in reuse]

    def propose(
        self,
        last: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        count: int,
        pick: Callable[[int, torch.Tensor, list[int]], int],
    ) -> list[list[int]]:
        """``count`` tokens per row after ``last`` ``[B, 1]`` (at ``positions + 1``), one draft forward each.

        ``pick(row, logits [1, V], proposed so far)`` chooses each row's proposal. Afterwards the cache holds
        ``count`` more columns (``last`` and all proposals but the last); ``mask`` is the mask before ``last``.
        """
        proposals: list[list[int]] = [[] for _ in range(last.shape[0])]
        fed = last
        for step in range(count):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self.forward(fed, mask, (positions + 1 + step)[:, None])
            for row, proposed in enumerate(proposals):
                proposed.append(pick(row, logits[row : row + 1], proposed))
            fed = torch.tensor([[proposed[-1]] for proposed in proposals], device=last.device)
        return proposals

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One draft forward through :attr:`cache`; the last position's logits ``[B, V]`` (fp32)."""
        depth = self.settings.early_exit_layers
        with truncated_depth(self.model, depth) if depth else contextlib.nullcontext():
            out = forward(
                self.model,
                self.cache,
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                logits_to_keep=1,
            )
        self.forwards += 1
        return out.logits[:, -1, :].float()

    def save(self, tail: bool) -> None:
        """Write the draft cache's completed chunks back (a chunk-reuse cache; a no-op otherwise)."""
        save = getattr(self.cache, "save", None)
        if save is not None:
            save(tail=tail)
