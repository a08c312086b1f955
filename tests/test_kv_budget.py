"""Tests of :mod:`kvboost_hf.kv_budget`: the projection of a batch's width against a walk of the decode loop's
layout written here, the bytes of a batch, the budget setting, and the bytes per token against a real cache's
tensors. The scheduler's admission and preemption with it are tested in test_scheduling.py."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import make_tiny_model
from helpers import word_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache

from kvboost_hf import KVBoost
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.hf.graphs import GraphConfig, graphed_columns, graphed_drafts, graphed_rows
from kvboost_hf.hf.speculative import DraftConfig
from kvboost_hf.kv_budget import BatchShape, KVBudget, resolve_budget_bytes


def widest_in_the_loop(width: int, running: list[int], joining: list[tuple[int, int]]) -> int:
    """The widest the decode loop's left-padded batch gets, walked step by step: running rows (tokens left each)
    ``width`` wide, and joining rows ``(context, tokens left)`` whose prefill completes in the first step. A step
    decodes the running rows (one column), then the prefilled rows join, as wide as the wider of the batch and their
    context, having taken their first token; columns are never trimmed; the batch widens while a row runs."""
    left = list(running)
    widest = width
    if left:
        width += 1  # the first step's decode
        left = [n - 1 for n in left]
    if joining:
        width = max(width, *(context for context, _ in joining))
        left += [n - 1 for _, n in joining]
    widest = max(widest, width)
    while any(n > 0 for n in left):
        width += 1
        left = [n - 1 for n in left if n > 1]
        widest = max(widest, width)
    return widest


shapes = st.builds(
    lambda width, running, joining: (width if running else 0, running, joining),
    st.integers(1, 40),
    st.lists(st.integers(1, 30), max_size=4),
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), max_size=4),
)


@given(shapes)
def test_the_projected_width_covers_the_loop_and_overshoots_by_at_most_one_column(shape):
    width, running, joining = shape
    projected = BatchShape(width, tuple(running), tuple(joining)).projected_width
    walked = widest_in_the_loop(width, running, joining) if running or joining else 0
    assert walked <= projected <= walked + 1


@given(shapes, st.integers(1, 4096), st.integers(1, 3))
def test_a_batch_holds_every_row_at_the_projected_width(shape, per_token, rounding):
    width, running, joining = shape
    budget = KVBudget(1, per_token, columns=lambda w: -(-w // rounding) * rounding)
    batch = BatchShape(width, tuple(running), tuple(joining))
    walked = widest_in_the_loop(width, running, joining) if running or joining else 0
    rows = len(running) + len(joining)
    assert budget.bytes(batch) >= rows * walked * per_token
    assert budget.bytes(batch) == rows * (-(-batch.projected_width // rounding) * rounding) * per_token


def cells_read(batches: list[list[int]]) -> int:
    """Cells (row x column) one decode step reads over ``batches`` of left-padded rows (each row's context given):
    every row of a batch as wide as its widest."""
    return sum(len(contexts) * max(contexts) for contexts in batches if contexts)


@given(shapes, st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_join_padding_is_what_a_join_adds_to_the_cells_a_step_reads_over_separate_batches(shape, contexts):
    """The batch's rows as the loop lays them out once its joining rows joined (every one as wide as the widest),
    then the new rows joining it or in a batch of their own: the join's extra padding is the difference."""
    width, running, joining = shape
    batch = BatchShape(width, tuple(running), tuple(joining))
    rows = [(context, 1) for context in contexts]
    laid_out = [width] * len(running) + [context for context, _ in joining]
    apart = cells_read([laid_out, contexts])
    together = cells_read([laid_out + contexts])
    assert batch.join_padding(rows) == (together - apart if laid_out else 0)
    assert batch.join_padding([]) == 0


def test_every_row_is_as_wide_as_the_widest_for_as_long_as_any_row_runs():
    """Written out: a batch 10 wide with a running row of 3 tokens left; a row of context 4 and 5 tokens left joins
    at width 10, so it ends at 15, not 9; rows of contexts 12 and 2 with 1 and 9 tokens left make every row 12 wide,
    then 9 more columns (21, not 13 or 11)."""
    shape = BatchShape(10, (3,)).join([(4, 5)])
    assert shape.projected_width == 15
    assert KVBudget(1, 2).bytes(shape) == 2 * 15 * 2
    assert BatchShape().join([(12, 1), (2, 9)]).projected_width == 21
    assert widest_in_the_loop(0, [], [(12, 1), (2, 9)]) == 20
    assert BatchShape().projected_width == 0


def test_a_graphed_batch_counts_its_padding_rows_and_its_capacity_bucket():
    """With graphs on, 3 rows decode in the 4-row graph (a padding row) at a 256-token capacity: the engine's budget
    counts 4 x 256 columns, not 3 x 15."""

    config = GraphConfig(row_buckets=(1, 2, 4, 8))
    graphed = KVBudget(
        1,
        2,
        columns=functools.partial(graphed_columns, config=config),
        rows=functools.partial(graphed_rows, config=config),
    )
    shape = BatchShape(10, (5, 5, 5))
    assert shape.projected_width == 15 and KVBudget(1, 2).bytes(shape) == 3 * 15 * 2
    assert graphed.bytes(shape) == 4 * 256 * 2
    assert graphed_rows(9, config) == 9  # above the largest bucket: eager, no padding


def test_a_draft_trees_columns_beyond_its_depth_widen_every_batch():
    """A batch 10 wide whose rows may take 5 and 3 tokens: a chain round is at most 4 deep (root and 4 nodes: 15
    columns, the projection); a tree round with 4 nodes beyond its depth holds 19, so the budget counts 2 rows x 19
    columns; a batch of no row holds nothing. The drafter's figure, by hand from DraftConfig.level_sizes' rule:
    trees of 8 nodes at most 2 deep, 2 children per node: 1 deep [2] (1 beyond), 2 deep [2, 4] (4 beyond); a
    3-children 9-node budget at most 3 deep: [3, 3, 3] (6 beyond); adaptive budgets 1 to 8 at most 2 deep: still 4;
    chains: none."""
    shape = BatchShape(10, (5, 3))
    assert KVBudget(1, 2).bytes(shape) == 2 * 15 * 2
    assert KVBudget(1, 2, tree_columns=4).bytes(shape) == 2 * 19 * 2
    assert KVBudget(1, 2, tree_columns=4).bytes(BatchShape()) == 0
    assert DraftConfig(num_draft_tokens=2, tree_budget=8).extra_tree_columns() == 4
    assert DraftConfig(num_draft_tokens=3, tree_budget=9, tree_branching=3).extra_tree_columns() == 6
    assert DraftConfig(num_draft_tokens=2, tree_budget=8, adaptive_tree_budget=True).extra_tree_columns() == 4
    assert DraftConfig(num_draft_tokens=5).extra_tree_columns() == 0
    with pytest.raises(ConfigError):
        KVBudget(1, 1, tree_columns=-1)


def test_an_engine_with_a_tree_drafter_counts_its_tree_in_the_budget():
    target = make_tiny_model("llama", seed=0)
    tree = KVBoost(target, word_tokenizer(), draft_model=target, draft=DraftConfig(num_draft_tokens=2, tree_budget=8))
    chain = KVBoost(target, word_tokenizer(), draft_model=target, draft=DraftConfig(num_draft_tokens=2))
    plain = KVBoost(target, word_tokenizer())
    budgets = [engine.factories.kv_budget(1 << 20) for engine in (tree, chain, plain)]
    assert [budget.tree_columns for budget in budgets if budget is not None] == [4, 0, 0]


def test_a_graphed_verify_forwards_padded_draft_tokens_are_counted():
    """Verify forwards that may run graphed pad a round's draft tokens up to a draft bucket (2, 4, 8, ...): a chain
    of at most 3 drafts pads 3 to 4 (1 column beyond its depth); trees of 8 nodes at most 2 deep: [2] holds 2 (1
    beyond), [2, 4] holds 6 padded to 8 (6 beyond); with buckets (2, 4) those 6 nodes are above the largest and run
    eagerly, unpadded (4 beyond). An engine whose graphs are on counts the padded figure, one whose graphs are off
    the real one."""
    config = GraphConfig(draft_buckets=(2, 4))
    padded = functools.partial(graphed_drafts, config=GraphConfig())
    assert [graphed_drafts(nodes, config) for nodes in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 5]
    assert DraftConfig(num_draft_tokens=3).extra_tree_columns(padded) == 1
    assert DraftConfig(num_draft_tokens=2, tree_budget=8).extra_tree_columns(padded) == 6
    small_buckets = functools.partial(graphed_drafts, config=config)
    assert DraftConfig(num_draft_tokens=2, tree_budget=8).extra_tree_columns(small_buckets) == 4
    target = make_tiny_model("llama", seed=0)
    draft = DraftConfig(num_draft_tokens=2, tree_budget=8)
    columns = [
        KVBoost(target, word_tokenizer(), draft_model=target, draft=draft, graphs=GraphConfig(enabled=enabled))
        .factories.kv_budget(1 << 20)
        .tree_columns
        for enabled in (True, False)
    ]
    assert columns == [6, 4]


def test_the_budget_setting_is_derived_on_cuda_only_and_checked():
    cpu = torch.device("cpu")
    assert resolve_budget_bytes(None, cpu) == 0  # no budget on the host
    assert resolve_budget_bytes(0, cpu) == 0
    assert resolve_budget_bytes(12345, cpu) == 12345
    with pytest.raises(ConfigError):
        resolve_budget_bytes(-1, cpu)
    for bad in ("1GB", 1.5e9, True):  # a string raised TypeError; a float or a bool passed as bytes
        with pytest.raises(ConfigError, match="kv_budget_bytes must be None"):
            resolve_budget_bytes(bad, cpu)
    with pytest.raises(ConfigError):
        KVBudget(0, 1)
    with pytest.raises(ConfigError):
        KVBudget(1, 0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_bytes_per_token_are_what_a_real_cache_holds_per_token(name):
    """Against the tensors of a ``DynamicCache`` (sliding-window layers included) after a forward of 7 tokens."""
    model = make_tiny_model(name, seed=0)
    engine = KVBoost(model, word_tokenizer(), chunking=8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(1, 8)[None], cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert engine.factories.kv_bytes_per_token() == held // 7
    assert held % 7 == 0
