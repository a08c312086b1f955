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
:class:`Speculation` wraps one call: it sets the draft schedule explicitly from :class:`DraftConfig`, gives the
draft a chunk-reuse cache, and counts target forwards and proposals::

    with Speculation(model, draft, DraftConfig(num_draft_tokens=5), lambda: ChunkReuseCache(store, draft)) as s:
        model.generate(ids, cache=ChunkReuseCache(store, model), **s.generate_kwargs(), ...)
    s.stats.target_forwards
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.core.errors import ArgumentTypeError, ConfigError, StateError
from kvboost_hf.core.values import is_finite, is_integer
from kvboost_hf.hf.models import CACHE_ARGUMENT, given_cache, model_dtype, truncated_depth
from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.transfer import to_device

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "heuristic", "heuristic_transient")
TREE_EXPANSIONS = ("level", "global")
_SCHEDULE_FIELDS = ("num_assistant_tokens", "assistant_confidence_threshold", "num_assistant_tokens_schedule")
_WRAPPED = "_kvboost_draft_wrapped"


@dataclass(frozen=True)
class DraftConfig:
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
        tree_budget: draft tokens per row and round of the decode loop's draft *tree* (0: a chain of
            ``num_draft_tokens``); the tree is ``num_draft_tokens`` deep at most.
        tree_branching: children per expanded tree node (the draft's most probable continuations).
        tree_expansion: how each draft forward's nodes are chosen: ``"level"`` keeps the children of the nodes the
            previous forward added with the highest cumulative draft log-probability (one tree level per forward);
            ``"global"`` chooses among every candidate not taken yet, siblings left at shallower depths included
            (SpecExec-style: the budget goes where the draft is unsure, and rows get their own shapes).
        adaptive_tree_budget: pick each round's tree budget (at most ``tree_budget``) from the measured cost of
            the target's verify forwards (:class:`VerifyCosts`): the largest budget whose extra nodes cost at most
            ``tree_overhead`` times a forward's fixed cost. A streamed target (the weight copy dominates) gets
            large trees, a resident one small trees.
        tree_overhead: with ``adaptive_tree_budget``: the share of a verify forward's fixed cost its tree nodes
            may add (0.25: at most 25% slower than a forward of the root alone).
    """

    num_draft_tokens: int = 5
    confidence_threshold: float = 0.0
    schedule: str = "constant"
    early_exit_layers: int | None = None
    tree_budget: int = 0
    tree_branching: int = 2
    tree_expansion: str = "level"
    adaptive_tree_budget: bool = False
    tree_overhead: float = 0.25

    def __post_init__(self) -> None:
        if not is_integer(self.num_draft_tokens) or self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be a positive integer, got {self.num_draft_tokens!r}")
        if not (is_finite(self.confidence_threshold) and 0.0 <= self.confidence_threshold < 1.0):
            raise ConfigError(f"confidence_threshold must be in [0, 1), got {self.confidence_threshold!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.early_exit_layers is not None and (
            not is_integer(self.early_exit_layers) or self.early_exit_layers < 1
        ):
            raise ConfigError(f"early_exit_layers must be a positive integer, got {self.early_exit_layers!r}")
        if not is_integer(self.tree_budget) or self.tree_budget < 0:
            raise ConfigError(f"tree_budget must be an integer >= 0, got {self.tree_budget!r}")
        if not is_integer(self.tree_branching) or self.tree_branching < 1:
            raise ConfigError(f"tree_branching must be a positive integer, got {self.tree_branching!r}")
        if self.tree_expansion not in TREE_EXPANSIONS:
            raise ConfigError(f"tree_expansion must be one of {TREE_EXPANSIONS}, got {self.tree_expansion!r}")
        if not isinstance(self.adaptive_tree_budget, bool):
            raise ConfigError(f"adaptive_tree_budget must be True or False, got {self.adaptive_tree_budget!r}")
        if self.adaptive_tree_budget and self.tree_budget < 1:
            raise ConfigError("adaptive_tree_budget needs tree_budget >= 1: the largest budget it may choose")
        if not (is_finite(self.tree_overhead) and 0.0 < self.tree_overhead <= 100.0):
            raise ConfigError(f"tree_overhead must be in (0, 100], got {self.tree_overhead!r}")

    def level_sizes(self, depth: int, budget: int | None = None) -> list[int]:
        """Draft nodes per tree level (level 1 = the root's children) for a tree at most ``depth`` deep (and at most
        ``num_draft_tokens``): a chain of ones without a tree budget; else the budget (``budget``, default
        ``tree_budget``) is spread over the depth, each level holding up to ``budget // depth`` nodes (at least 1)
        and up to ``tree_branching`` times the previous level, until ``budget`` nodes are spent."""
        depth = min(depth, self.num_draft_tokens)
        budget = self.tree_budget if budget is None else budget
        if not budget:
            return [1] * depth
        width = max(1, budget // depth)
        sizes: list[int] = []
        while len(sizes) < depth and sum(sizes) < budget:
            wanted = min(width, self.tree_branching * (sizes[-1] if sizes else 1))
            sizes.append(min(wanted, budget - sum(sizes)))
        return sizes

    def extra_tree_columns(self, padded: Callable[[int], int] | None = None) -> int:
        """The most columns a round's tree holds per row beyond its depth: its nodes less its levels
        (:meth:`level_sizes`), over every depth up to ``num_draft_tokens`` and every budget a round may take (up to
        ``tree_budget`` with ``adaptive_tree_budget``, else ``tree_budget``); 0 for an eager chain. A verify forward
        holds each row's root and every node until the rejected ones are dropped, and a round is at most one less
        deep than the most tokens a row may take, so a batch ``W`` columns wide whose rows may take at most ``L``
        tokens holds at most ``W + L + extra_tree_columns()`` columns during a step (see :mod:`kvboost_hf.kv_budget`).
        ``padded``: the draft tokens a verify forward of ``n`` nodes holds, when verify forwards may run graphed
        (padded up to a draft bucket: :func:`~kvboost_hf.hf.graphs.graphed_drafts`); None: ``n``."""
        budgets: Sequence[int | None] = range(1, self.tree_budget + 1) if self.adaptive_tree_budget else [None]
        held = padded or (lambda nodes: nodes)
        return max(
            held(sum(sizes)) - len(sizes)
            for depth in range(1, self.num_draft_tokens + 1)
            for budget in budgets
            for sizes in [self.level_sizes(depth, budget)]
        )

    def adaptive_budget(self, costs: VerifyCosts, rows: int) -> int:
        """The tree budget per row for a verify forward of ``rows`` rows, from the verify forwards timed so far:
        ``tree_overhead * fixed / (per_node * rows)`` nodes (the extra nodes cost at most that share of the
        forward's fixed cost), between 1 and ``tree_budget``; ``tree_budget`` when nodes cost nothing measurable.
        Until two different node counts were timed it explores: ``tree_budget`` first, then a single node (or
        ``tree_budget`` again when the timed count is already one node a row)."""
        fit = costs.fit()
        if fit is None:
            one_node_rounds = bool(costs.samples) and costs.samples[-1][0] <= 2 * rows  # a node and its root a row
            return self.tree_budget if not costs.samples or one_node_rounds else 1
        fixed, per_node = fit
        if per_node <= 0.0:
            return self.tree_budget
        affordable = self.tree_overhead * fixed / (per_node * rows) + 1e-6  # not 19.999... for 20
        return max(1, min(self.tree_budget, int(affordable)))

    def check(self, target: PreTrainedModel, draft: PreTrainedModel | None) -> None:
        """Raise ValueError when these settings cannot draft for ``target`` with ``draft`` (a model or None)."""
        exit_layers = self.early_exit_layers
        if exit_layers is None:
            return
        if draft is not None:
            raise ConfigError("give either a draft model or early_exit_layers, not both")
        layers = target.config.get_text_config(decoder=True).num_hidden_layers
        if exit_layers >= layers:
            raise ConfigError(f"early_exit_layers must be below the target's {layers} layers, got {exit_layers}")

    def generation_fields(self) -> dict[str, Any]:
        """The assistant ``generation_config`` fields that fix this schedule."""
        values = (self.num_draft_tokens, self.confidence_threshold, self.schedule)
        return dict(zip(_SCHEDULE_FIELDS, values, strict=True))


DraftSettings = DraftConfig  # the name of earlier versions, still in README examples


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
        settings: DraftConfig | None = None,
        draft_cache: Callable[[], Cache] | None = None,
    ) -> None:
        self.target = target
        self.settings = settings or DraftConfig()
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
                raise StateError("this draft model is already drafting for another generate() call")
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
        if self.draft_cache is not None and given_cache(kwargs) is None:
            cache = kwargs[CACHE_ARGUMENT] = self.draft_cache()
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
        raise ArgumentTypeError(
            f"draft_model must be a path, a PreTrainedModel or an engine, got {type(draft).__name__}"
        )
    if tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ConfigError("the draft's tokenizer differs from the target's: speculative decoding needs one vocabulary")
    draft_vocab = model.config.get_text_config(decoder=True).vocab_size
    target_vocab = target.config.get_text_config(decoder=True).vocab_size
    if draft_vocab != target_vocab:
        raise ConfigError(f"the draft's vocabulary has {draft_vocab} entries, the target's {target_vocab}")
    return model.eval()


@dataclass
class DraftTree:
    """One row's draft tokens for one round, in the order the draft chose them: node ``j`` holds ``tokens[j]``, its
    parent ``parents[j]`` (-1: the root, the row's last token, already chosen) and its ``depths[j]`` (>= 1). A parent
    precedes its children. The first ``fed`` nodes were fed to the draft (its cache holds them; the others, chosen
    by the last expansion step, have no children). The rows of a round have as many nodes and fed nodes."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    fed: int = 0

    def add(self, token: int, parent: int) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` (-1: the root) holding ``token``, or None."""
        return next((j for j, (t, p) in enumerate(zip(self.tokens, self.parents, strict=True))
                     if p == node and t == token), None)  # fmt: skip

    def has_children(self, node: int) -> bool:
        return node in self.parents

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        nodes: list[int] = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def sees(self) -> torch.Tensor:
        """``[N, N]`` bool: node ``q`` attends to node ``k`` (``k`` is ``q`` or one of its ancestors)."""
        sees = torch.eye(len(self.tokens), dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                sees[node] |= sees[parent]
        return sees


def acceptance_by_depth(rounds: Iterable[tuple[int, bool]]) -> list[float]:
    """Per depth ``d = 1, 2, ...``: the fraction of verify rounds that reached depth ``d - 1`` of the draft and had
    a proposal there in which the row's own choice was proposed (accepted), from ``(draft tokens accepted, whether a
    differing proposal ended the round)`` per round (:attr:`~kvboost_hf.hf.decode.DecodeRow.draft_rounds`). A round
    that ended on a finished row or on the tree's last level offers nothing deeper. Ratio of sums over the depths:
    the row's per-position acceptance (accepted / (accepted + rejected))."""
    rounds = list(rounds)
    deepest = max((accepted + rejected for accepted, rejected in rounds), default=0)
    rates = []
    for depth in range(1, deepest + 1):
        kept = sum(1 for accepted, _ in rounds if accepted >= depth)
        refused = sum(1 for accepted, rejected in rounds if rejected and accepted == depth - 1)
        rates.append(kept / (kept + refused))
    return rates


def tree_attention_mask(context: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask ``[B, 1, Q, C + K]`` of ``Q`` tree queries: each sees the context columns where
    ``context`` ``[B, C]`` is 1 and the tree columns where ``visible`` ``[B, Q, K]`` is true."""
    queries = visible.shape[1]
    allowed = torch.cat([context.bool()[:, None, :].expand(-1, queries, -1), visible.to(context.device)], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=context.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class VerifyCosts:
    """Timed verify forwards of one target: ``samples`` holds the last ``window`` ``(nodes, seconds)`` pairs (tree
    nodes of all rows, roots included, and the forward's wall time in seconds, until its greedy choices reached the
    host: :meth:`TreeVerifier.step <kvboost_hf.hf.verify.TreeVerifier.step>`); :meth:`fit` is the least-squares line
    ``seconds = fixed + per_node * nodes``. Old samples leave the window, so a budget that stays constant
    eventually leaves a single node count and :meth:`DraftConfig.adaptive_budget` explores again."""

    def __init__(self, window: int = 64) -> None:
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def add(self, nodes: int, seconds: float) -> None:
        self.samples.append((nodes, seconds))

    def fit(self) -> tuple[float, float] | None:
        """``(fixed seconds, seconds per node)``, or None until two different node counts were timed."""
        if len({nodes for nodes, _ in self.samples}) < 2:
            return None
        count = len(self.samples)
        mean_nodes = sum(nodes for nodes, _ in self.samples) / count
        mean_seconds = sum(seconds for _, seconds in self.samples) / count
        spread = sum((nodes - mean_nodes) ** 2 for nodes, _ in self.samples)
        covariance = sum((nodes - mean_nodes) * (seconds - mean_seconds) for nodes, seconds in self.samples)
        per_node = covariance / spread
        return mean_seconds - per_node * mean_nodes, per_node


class Drafter:
    """The draft side of speculative decoding in :class:`~kvboost_hf.hf.decode.DecodeLoop`, and its policy: whether a
    forward verifies trees and how large they are (:meth:`tree_sizes`); the target side is
    :class:`~kvboost_hf.hf.verify.TreeVerifier`.

    Args:
        model: the resident draft (sharing the target's vocabulary), or the target itself when
            ``settings.early_exit_layers`` is set (the draft is then its first layers and its head).
        settings: ``num_draft_tokens`` proposed per round; ``early_exit_layers``.
        new_cache: builds the draft's cache for rows with the given segment starts (e.g. a chunk-reuse cache on the
            target's store, under the draft's own namespace); None = a ``DynamicCache``.
        costs: the target's timed verify forwards, shared by the drafters of one engine (with
            ``settings.adaptive_tree_budget``; None: a fresh record).

    Invariant: between rounds, :attr:`cache` holds exactly the target cache's columns (the same left-padded layout,
    one column per token fed to the target), so the loop's attention mask and positions serve both. ``forwards``
    counts draft forwards; ``cached_tokens`` is what the draft's prefills loaded per row (in prefill order).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        settings: DraftConfig,
        new_cache: Callable[[tuple[int, ...]], Cache] | None = None,
        costs: VerifyCosts | None = None,
    ) -> None:
        self.model = model
        self.settings = settings
        self.new_cache = new_cache
        self.costs = costs if costs is not None else VerifyCosts()
        self.cache: Cache | None = None
        self.forwards = 0
        self.cached_tokens: list[int] = []

    def tree_sizes(self, tokens_left: Sequence[int]) -> list[int] | None:
        """The speculation policy: nodes per level of the next round's trees for rows that may still take
        ``tokens_left`` tokens each, or None when the round should draft nothing (no row can take two tokens: its
        proposals could not be used). The trees are at most one less deep than the largest budget and hold the
        settings' tree budget, or with ``adaptive_tree_budget`` the one the timed verify forwards suggest for this
        many rows."""
        most = max(tokens_left, default=0)
        if most <= 1:
            return None
        settings = self.settings
        budget = settings.adaptive_budget(self.costs, len(tokens_left)) if settings.adaptive_tree_budget else None
        return settings.level_sizes(most - 1, budget)

    def prefill(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        segment_starts: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Run the draft over the left-padded prompts on a fresh cache (built for the rows' ``segment_starts``);
        returns the last position's logits ``[B, V]`` (fp32): the draft's view of each row's first token."""
        self.cache = self.new_cache(segment_starts) if self.new_cache is not None else DynamicCache()
        logits = self.forward(input_ids, mask, position_ids)
        reuse = getattr(self.cache, "last_reuse", None) or []
        self.cached_tokens += [entry.cached_tokens for entry in reuse]
        return logits

    def follow(self, rows: Sequence[Any], mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Feed the draft what a plain (not speculative) target step fed: each row's last token at ``positions``
        ``[B]`` under ``mask`` ``[B, C]`` (its new column included), so the draft cache keeps the target's columns
        (a prompt joined next pads both alike; a draft one column short failed the next round's forward)."""
        last = torch.tensor([[row.tokens[-1]] for row in rows], dtype=torch.long).to(mask.device, non_blocking=True)
        self.forward(last, mask, positions[:, None])

    def propose(
        self,
        last: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        sizes: Sequence[int],
        scores: Callable[[int, torch.Tensor, list[int]], torch.Tensor],
    ) -> list[DraftTree]:
        """A draft tree per row after ``last`` ``[B, 1]`` (the roots, fed now at ``positions + 1``; ``mask`` is the
        2D mask before them); see :meth:`expand`."""
        context = torch.cat([mask, mask.new_ones(last.shape[0], 1)], dim=1)  # the roots' column joins the context
        logits = self.forward(last, context, (positions + 1)[:, None])
        return self.expand(logits, context, positions + 1, sizes, scores)

    def expand(
        self,
        logits: torch.Tensor,
        context: torch.Tensor,
        root_positions: torch.Tensor,
        sizes: Sequence[int],
        scores: Callable[[int, torch.Tensor, list[int]], torch.Tensor],
    ) -> list[DraftTree]:
        """A draft tree per row below its root, the last column of the draft's cache (``context`` ``[B, C]``: its 2D
        mask, the roots' column last; ``root_positions`` ``[B]``; ``logits`` ``[B, V]``: the draft's after each
        root), grown in ``len(sizes)`` steps, step ``d`` adding ``sizes[d]`` nodes per row: the candidates with the
        highest cumulative draft log-probability (``scores(row, logits [1, V], path tokens)`` gives a node's
        log-probs; each fed node offers its top ``tree_branching``). Candidates are the children of the nodes the
        previous step added (``tree_expansion="level"``: step ``d`` adds depth ``d + 1``), or every candidate not
        taken yet (``"global"``).

        One draft forward per step but the last (it feeds that step's nodes); afterwards the cache also holds the
        fed nodes, in tree order.
        """
        rows = logits.shape[0]
        trees = [DraftTree() for _ in range(rows)]
        keep_pool = self.settings.tree_expansion == "global"
        pools: list[list[tuple[float, int, int]]] = [[] for _ in range(rows)]  # (score, parent, token) untaken
        newest = [[(0.0, -1)] for _ in range(rows)]  # the last fed nodes: (cumulative log-prob, node) per row
        node_logits = logits[:, None]  # [B, newest nodes, V]
        for step, size in enumerate(sizes, start=1):
            for row, tree in enumerate(trees):
                offered = self._children(tree, newest[row], node_logits[row], functools.partial(scores, row))
                pool = sorted(offered + pools[row], key=lambda candidate: -candidate[0])
                pools[row] = pool[size:] if keep_pool else []
                newest[row] = []
                for score, parent, token in pool[:size]:
                    newest[row].append((score, len(tree.tokens)))
                    tree.add(token, parent)
            if step == len(sizes):
                break
            start = len(trees[0].tokens) - size
            fed = to_device([tree.tokens[start:] for tree in trees], logits.device)
            visible = torch.stack([tree.sees()[start:] for tree in trees])  # [B, size, nodes so far]
            tree_mask = tree_attention_mask(context, visible, model_dtype(self.model))
            depths = to_device([tree.depths[start:] for tree in trees], logits.device)
            node_logits = self.forward(fed, tree_mask, root_positions[:, None] + depths, keep=size)
            node_logits = node_logits.reshape(rows, size, -1)
            for tree in trees:
                tree.fed = len(tree.tokens)
        return trees

    def _children(
        self,
        tree: DraftTree,
        nodes: list[tuple[float, int]],
        logits: torch.Tensor,
        scores: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ) -> list[tuple[float, int, int]]:
        """The candidates ``(cumulative log-prob, parent, token)`` that ``nodes`` (``(cumulative log-prob, node)``,
        their draft logits ``[len(nodes), V]``) offer: each node's top ``tree_branching`` continuations."""
        candidates = []
        for slot, (score, node) in enumerate(nodes):
            log_probs = scores(logits[slot : slot + 1], [tree.tokens[n] for n in tree.path(node)])
            top = log_probs.topk(min(self.settings.tree_branching, log_probs.shape[-1]))
            candidates += [(score + float(v), node, int(t)) for v, t in zip(top.values, top.indices, strict=True)]
        return candidates

    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, keep: int = 1
    ) -> torch.Tensor:
        """One draft forward through :attr:`cache` (``mask``: 2D, or a 4D additive tree mask); the last ``keep``
        positions' logits (fp32), ``[B, V]`` for ``keep == 1`` else ``[B, keep, V]``."""
        depth = self.settings.early_exit_layers
        with truncated_depth(self.model, depth) if depth else contextlib.nullcontext():
            out = forward(
                self.model,
                self.cache,
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                logits_to_keep=keep,
            )
        self.forwards += 1
        logits = out.logits[:, -keep:, :].float()
        return logits[:, -1, :] if keep == 1 else logits

    def save(self, tail: bool) -> None:
        """Write the draft cache's completed chunks back (a chunk-reuse cache; a no-op otherwise)."""
        save = getattr(self.cache, "save", None)
        if save is not None:
            save(tail=tail)
