"""The scheduler's K/V memory accounting: what a running batch's caches may grow to, in bytes, against a budget.

The layout counted is the decode loop's (:class:`~kvboost_hf.hf.decode.DecodeLoop`): a batch's caches are
left-padded, so every running row holds as many columns as the batch is wide; the width is that of the widest row
ever admitted to it (its leading columns are trimmed only once they are padding for every row left, which the
projection does not count on: it stays an upper bound) and grows by one column per decode step, also
during the steps a joining row spends being prefilled. A batch of ``rows`` rows ``width`` columns wide holds
``rows x width x bytes_per_token`` bytes (:attr:`KVBudget.bytes_per_token`: layers x 2 (keys, values) x kv_heads x
head_dim x the dtype's size, the target's cache and a draft's added). Sliding-window layers keep every column (README,
Limitations), so this counts eager decoding's columns exactly (not the headroom a growing reuse cache allocates
beyond them: :func:`~kvboost_hf.hf.layers.grown_capacity`'s at least 256 columns per row, which the share of free
memory the budget leaves must hold); where graphed decoding makes a cache static at a capacity bucket,
:attr:`KVBudget.columns` rounds the width up to it and :attr:`KVBudget.rows` the rows up to the row bucket its
padding rows fill (an upper bound).

Projection (:meth:`BatchShape.projected_width`): the widest a batch gets if the rows it admitted and has not
prefilled yet (and the rows admission tries) joined at once and every row took every token its budget allows:
``max(width, longest context of a joining row) + most tokens left of any row``, ``context`` being what a row's
prefill computes or loads (its prompt, and the tokens it took before a preemption): the joins make every row as wide
as the widest, and the batch then widens by a column per step while any row runs. It overshoots the loop's widest
by at most one column (the first token of a joining row comes from its prefill). It is at least what the batch
holds after its next step (a decode step adds one column, a completed
prefill joins at most as wide as its prompts), so a schedule whose projection fits the budget runs its step within
it. It is not a bound for ever: a prefill spread over several steps (the token budget) lets the running rows widen
the batch meanwhile, and a speculative step may take more tokens for one row than for another; so the scheduler
projects again before every step and preempts when the sum exceeds the budget.

Speculative steps: a verify forward appends each row's root and every node of its draft tree to both caches (the
prompt forward that verifies the first tree, its nodes after the prompt) until the rejected columns are dropped. A
round is at most one less deep than the most tokens a row may take, so a chain's columns are within the projection;
a tree's nodes beyond its depth are not, and :attr:`KVBudget.tree_columns` (the drafter's
:meth:`~kvboost_hf.hf.speculative.DraftConfig.extra_tree_columns`) adds them to every batch's width: a schedule
whose projection fits the budget runs its step, verify forward included, within it.

A graphed verify forward pads each round's draft tokens up to a draft bucket (padding nodes after the real ones,
dropped with the rejected nodes): where verify forwards may run graphed, ``tree_columns`` counts the padded rounds
(``extra_tree_columns(padded=graphed_drafts)``), a chain's padding included.

Not counted: what a forward holds while it runs besides the caches (activations, logits, the copy a join or a
repeated prompt makes), and the graphs' static buffers no cache uses between requests (at most 5% of the device's
memory: :mod:`~kvboost_hf.hf.static_buffers`): the share of free memory the budget leaves (:data:`DEVICE_FRACTION`)
is for those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.values import is_integer

#: Share of a CUDA device's free memory (when the scheduler is built) that a default K/V budget takes; the rest is
#: for activations, logits, a GPU store tier still filling and other processes. The one place it is written.
DEVICE_FRACTION = 0.5


def _unchanged(count: int) -> int:
    return count


@dataclass(frozen=True)
class KVBudget:
    """Device memory the running batches' K/V may take.

    Args:
        budget_bytes: bytes (> 0).
        bytes_per_token: bytes one row's caches hold per column (> 0): layers x 2 x kv_heads x head_dim x the
            dtype's size, summed over the target's and a draft's caches.
        columns: the columns a cache holds when the batch is ``width`` wide (graphed decoding rounds up to a
            capacity bucket); must be monotone and >= ``width``.
        rows: the rows a cache holds for a batch of ``rows`` rows (graphed decoding pads up to a row bucket); must
            be monotone and >= ``rows``.
        tree_columns: columns a speculative step's draft tree holds per row beyond its depth, added to every
            batch's projected width (0: no draft, or chains; see the module docstring); >= 0.
    """

    budget_bytes: int
    bytes_per_token: int
    columns: Callable[[int], int] = _unchanged
    rows: Callable[[int], int] = _unchanged
    tree_columns: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.bytes_per_token <= 0 or self.tree_columns < 0:
            raise ConfigError(
                f"a K/V budget needs budget_bytes > 0, bytes_per_token > 0 and tree_columns >= 0, got "
                f"{self.budget_bytes}, {self.bytes_per_token} and {self.tree_columns}"
            )

    def bytes(self, shape: BatchShape) -> int:
        """Bytes ``shape``'s batch holds at most in a step: rows x columns (its projected width, and the draft
        tree's columns beyond its depth) x bytes per token; 0 with no row."""
        if not shape.rows:
            return 0
        width = shape.projected_width + self.tree_columns
        return self.rows(shape.rows) * self.columns(width) * self.bytes_per_token


@dataclass(frozen=True)
class BatchShape:
    """A batch as the projection sees it: ``width`` (columns each running row holds now; 0 with none running),
    each running row's tokens left (``running``), and each joining row's ``(context tokens, tokens left)``
    (``joining``: rows admitted whose prefill is not complete, and rows admission tries). Tokens left are >= 1 (a
    row with none has ended)."""

    width: int = 0
    running: tuple[int, ...] = ()
    joining: tuple[tuple[int, int], ...] = ()

    @property
    def rows(self) -> int:
        return len(self.running) + len(self.joining)

    @property
    def projected_width(self) -> int:
        """The widest the batch gets if every joining row joined now and each row took all its tokens (0 with no
        row): ``max(width, longest joining context) + most tokens left`` (see the module docstring)."""
        if not self.rows:
            return 0
        joined = max((context for context, _ in self.joining), default=0)
        return max(self.width, joined) + max((*self.running, *(left for _, left in self.joining)))

    def join_padding(self, rows: Sequence[tuple[int, int]]) -> int:
        """Cells (row x column) of left padding each decode step reads more when ``rows`` (``(context tokens,
        tokens left)`` each) join this batch than when they run in a batch of their own: with ``W`` the batch's
        width once its joining rows joined and ``C`` the widest new context, the batch's ``r`` rows widen by
        ``max(0, C - W)`` columns each, or the ``n`` new rows by ``max(0, W - C)`` (0 for a batch with no row).
        Times :attr:`KVBudget.bytes_per_token` it is the K/V bytes a step reads for nothing."""
        if not self.rows or not rows:
            return 0
        width = max((self.width, *(context for context, _ in self.joining)))
        widest = max(context for context, _ in rows)
        return self.rows * max(0, widest - width) + len(rows) * max(0, width - widest)

    def join(self, rows: Sequence[tuple[int, int]]) -> BatchShape:
        """This shape with ``rows`` (``(context tokens, tokens left)`` each) joining too."""
        return BatchShape(self.width, self.running, (*self.joining, *rows))


def free_device_bytes(device: torch.device) -> int:
    """Bytes a CUDA ``device`` can still give: what the driver reports free plus what torch's allocator holds
    unused (cached blocks, reusable without asking the driver)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def check_budget_setting(budget_bytes: int | None) -> None:
    """Raise :class:`ConfigError` unless ``budget_bytes`` is None (derived) or an integer of bytes >= 0 (0: none)."""
    if budget_bytes is not None and not (is_integer(budget_bytes) and budget_bytes >= 0):
        raise ConfigError(f"kv_budget_bytes must be None (derived), 0 (none) or an integer > 0, got {budget_bytes!r}")


def resolve_budget_bytes(budget_bytes: int | None, device: torch.device) -> int:
    """The K/V budget in bytes (0: none) for the setting ``budget_bytes``: None derives it, on a CUDA device
    :data:`DEVICE_FRACTION` of :func:`free_device_bytes` now, elsewhere none (host memory is not the scarce resource
    the budget guards, and a process may swap); 0 is none; else the bytes given (an integer >= 0)."""
    check_budget_setting(budget_bytes)
    if budget_bytes is not None:
        return budget_bytes
    if device.type != "cuda":
        return 0
    return int(free_device_bytes(device) * DEVICE_FRACTION)
