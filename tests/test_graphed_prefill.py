"""Short prefills over a reused cache graphed per query-length bucket (``GraphedDecoder.prefill``, the decode loop's
prompt forward): a warm chat turn's new tokens run through one graph per (rows, capacity, query bucket) with
generate()'s tokens and the eager runner's store; one graph serves every tail length of its bucket."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import make_tiny_model
from helpers import DECODE_EOS, CountingBackend, finish, new_loop, prefill, prefill_in_chunks, reuse_caches
from oracle import reference

from kvboost_hf import ChunkStore
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.hf.decode import DecodeRequest
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, graph_shape, parse_graph_shapes, query_bucket
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.store.config import StoreConfig

BUDGET = 6
FIRST_TURNS = [list(range(3, 43)), list(range(50, 83)), list(range(90, 120))]
NEW_MESSAGES = [list(range(5, 24)), list(range(60, 81)), list(range(20, 41))]


@pytest.fixture(scope="module", autouse=True)
def graphs_shared_by_the_module():
    """Dynamo's caches emptied once, at the module's start, not per test: a decode or prefill shape an earlier test
    compiled for a tiny Qwen2 replays that graph for this test's (same class, same weights), so each shape compiles
    once for the module; the decoders count their own prefills, steps and shapes either way. The tests on other
    architectures, counting compiles or failing one reset for themselves and run after the others."""
    torch._dynamo.reset()


GREEDY = SamplingConfig(temperature=0)
SAMPLED = [
    SamplingConfig(temperature=1.3, top_k=40, seed=11),
    SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.3, logit_bias=((7, 3.0),), seed=3),
    SamplingConfig(presence_penalty=0.6, frequency_penalty=0.4, min_tokens=5, seed=5),
]


def requests(prompts: list[list[int]], samplings: list[SamplingConfig]) -> list[DecodeRequest]:
    return [
        DecodeRequest(prompt_ids=p, max_new_tokens=BUDGET, sampling=sampling)
        for p, sampling in zip(prompts, samplings, strict=True)
    ]


def chat(
    model,
    graphs: GraphedDecoder | None,
    conversations: list[int],
    *,
    together: bool = True,
    columns: int = 0,
    samplings: list[SamplingConfig] | None = None,
):
    """Two turns of each conversation (indices into :data:`FIRST_TURNS`/:data:`NEW_MESSAGES`) in one reuse loop on
    a fresh store: the first turns, then the second turns (first turn + its answer + the new message; prefilled
    ``columns`` columns per call when > 0, as the scheduler's token budget does), all rows of a turn in one batch
    (``together``) or one conversation after the other; conversation ``i`` samples with ``samplings[i]`` (default
    greedy). Returns the second turns' prompts, their rows (tokens,
    reuse) and the store's chunks (key, entry) by key."""
    store = ChunkStore(StoreConfig(1 << 24))
    loop = new_loop(model, reuse_caches(store, model), graphs=graphs)
    groups = [conversations] if together else [[index] for index in conversations]
    samplings = samplings or [GREEDY] * len(FIRST_TURNS)
    seconds, rows = [], []
    for group in groups:
        settings = [samplings[i] for i in group]
        prefill(loop, requests([FIRST_TURNS[i] for i in group], settings))
        finish(loop)
        answers = [row.tokens for row in loop.rows[-len(group) :]]
        prompts = [FIRST_TURNS[i] + answer + NEW_MESSAGES[i] for i, answer in zip(group, answers, strict=True)]
        if columns:
            prefill_in_chunks(loop, requests(prompts, settings), columns)
        else:
            prefill(loop, requests(prompts, settings))
        finish(loop)
        seconds += prompts
        rows += loop.rows[-len(group) :]
    store.flush()  # on CUDA, chunks written back last may still be landing
    ram = store.tier("ram")
    assert ram is not None
    return seconds, rows, sorted(ram.items(), key=lambda item: item[0])


def warm_turn_prefills_graphed(device: str, backend: str | None, conversations: list[int]) -> None:
    """The second turns of ``conversations`` (together) prefill through one graph with generate()'s tokens; the
    store the graphed run writes back is the eager runner's, key for key, equal up to fp32 rounding (not bit for
    bit: a static cache attends over its whole capacity, masked, and padded rows change a matrix product's last
    bits)."""
    model = make_tiny_model("qwen2").to(device)
    config = GraphConfig(backend=backend)
    graphs = GraphedDecoder(model, config)
    prompts, rows, chunks = chat(model, graphs, conversations)
    _, eager_rows, eager_chunks = chat(model, None, conversations)
    tails = {len(prompt) - row.reuse.cached_tokens for prompt, row in zip(prompts, rows, strict=True)}
    assert all(row.reuse.cached_tokens > 0 for row in rows)  # a warm turn: the first turn's K/V reused
    assert not tails & set(config.query_buckets)  # the tail is padded: not at a bucket boundary
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == [row.tokens for row in eager_rows] == expected
    assert (graphs.graphed_prefills, graphs.eager_prefills, graphs.failed_shapes) == (1, 0, set())
    [prefill_shape] = [shape for shape in graphs.graph_shapes if len(shape) == 3]
    assert prefill_shape[0] == graphs.rows_for(len(conversations))
    assert prefill_shape[2] == query_bucket(max(tails), config.query_buckets)
    assert [key for key, _ in chunks] == [key for key, _ in eager_chunks] and chunks
    for (_, entry), (_, eager) in zip(chunks, eager_chunks, strict=True):
        assert torch.allclose(entry.keys, eager.keys, rtol=0, atol=1e-5)
        assert torch.allclose(entry.values, eager.values, rtol=0, atol=1e-5)


# 1 row and 2 rows (at their row bucket: stored chunks stitched straight into the static buffers, left-padded for
# 2); 3 rows in the 4-row graph (padded rows: the cache is made static after stitching)
@pytest.mark.parametrize("conversations", [[0], [0, 1], [0, 1, 2]])
def test_a_warm_chat_turn_prefills_graphed_with_generates_tokens_and_the_eager_store(conversations):
    warm_turn_prefills_graphed("cpu", "eager", conversations)  # traced, no code generation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("conversations", [[0], [0, 1, 2]])
def test_a_warm_chat_turn_prefills_cuda_graphed_with_generates_tokens_in_fp32(conversations):
    torch._dynamo.reset()
    warm_turn_prefills_graphed("cuda", None, conversations)  # inductor, reduce-overhead


def test_sampled_rows_of_a_graphed_warm_turn_draw_what_generate_draws_alone():
    """Seeded rows with their processors (top-k, top-p, penalties, bias, min_tokens): the graphed prefill's logits
    go through them as the eager forward's do."""
    model = make_tiny_model("qwen2")
    graphs = GraphedDecoder(model, GraphConfig(backend="eager"))
    prompts, rows, _ = chat(model, graphs, [0, 1, 2], samplings=SAMPLED)
    for prompt, row, sampling in zip(prompts, rows, SAMPLED, strict=True):
        assert row.tokens == reference(model, prompt, BUDGET, sampling, DECODE_EOS).tokens
    assert graphs.graphed_prefills == 1 and (4, 256, 32) in graphs.graph_shapes


@pytest.mark.parametrize(("columns", "graphed"), [(40, 1), (10, 0)])
def test_a_chunked_warm_turn_prefills_graphed_when_its_tail_fits_one_call(columns, graphed):
    """The scheduler's token budget splits a prompt wider than its columns: a tail of about 20 tokens after the
    reused K/V fits one call of 40 columns (graphed), not of 10 (computed in eager chunks)."""
    model = make_tiny_model("qwen2")
    graphs = GraphedDecoder(model, GraphConfig(backend="eager"))
    prompts, rows, _ = chat(model, graphs, [0], columns=columns)
    assert len(prompts[0]) > 40 and 10 < len(prompts[0]) - rows[0].reuse.cached_tokens <= 40
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected
    assert graphs.graphed_prefills == graphed and graphs.eager_prefills == 0


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (GraphConfig(backend="eager", query_buckets=(16,)), "a tail above the largest query bucket"),
        (GraphConfig(backend="eager", query_buckets=()), "no query buckets"),
        (GraphConfig(backend="eager", max_capacity=256, query_buckets=(256,)), "a padded tail above max_capacity"),
    ],
)
def test_prefills_outside_the_buckets_run_eagerly_with_generates_tokens(config, reason):
    model = make_tiny_model("qwen2")
    graphs = GraphedDecoder(model, config)
    prompts, rows, _ = chat(model, graphs, [0])
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected, reason
    assert graphs.graphed_prefills == 0 and all(len(shape) == 2 for shape in graphs.graph_shapes), reason


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])  # sliding windows of 24 columns; gemma2's eager attention
def test_a_warm_turn_prefills_graphed_with_generates_tokens_under_a_sliding_window(arch):
    """The padded tail (32 queries) is wider than the window and the reused K/V longer: the sliding-window mask over
    the static capacity hides what a real query may not see, the padding included."""
    model = make_tiny_model(arch)
    graphs = GraphedDecoder(model, GraphConfig(backend="eager"))
    torch._dynamo.reset()
    prompts, rows, _ = chat(model, graphs, [0])
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected
    assert graphs.graphed_prefills == 1 and (1, 256, 32) in graphs.graph_shapes


def test_one_prefill_graph_serves_two_tail_lengths_of_its_bucket():
    """Conversations 0 and 2, one after the other: tails of 22 and 24 tokens, both padded to 32, compile the
    prefill graph once (and the decode graph once)."""
    model = make_tiny_model("qwen2")
    backend = CountingBackend()
    graphs = GraphedDecoder(model, GraphConfig(backend=backend))  # type: ignore[arg-type]
    torch._dynamo.reset()
    prompts, rows, _ = chat(model, graphs, [0, 2], together=False)
    tails = [len(prompt) - row.reuse.cached_tokens for prompt, row in zip(prompts, rows, strict=True)]
    assert tails[0] != tails[1] and {query_bucket(tail, graphs.config.query_buckets) for tail in tails} == {32}
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected
    assert graphs.graph_shapes[(1, 256, 32)] == 2 and graphs.graphed_prefills == 2
    assert backend.compiles == 2 == len(graphs.graph_shapes)  # one decode graph, one prefill graph


def test_a_prefill_whose_compile_fails_runs_eagerly_with_the_same_tokens(caplog):
    compiles = []

    def prefill_breaks(graph_module, example_inputs):
        compiles.append(graph_module)
        if len(compiles) == 2:  # the first turn's decode graph compiles first, then the warm turn's prefill
            raise RuntimeError("no prefill graphs here")
        return graph_module.forward

    model = make_tiny_model("qwen2")
    graphs = GraphedDecoder(model, GraphConfig(backend=prefill_breaks))  # type: ignore[arg-type]
    torch._dynamo.reset()
    prompts, rows, _ = chat(model, graphs, [0])
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected
    assert graphs.failed_shapes == {(1, 256, 32)} and (graphs.graphed_prefills, graphs.eager_prefills) == (0, 1)
    assert graphs.graphed_steps > 0 and "runs eagerly" in caplog.text


def test_warmed_up_prefill_and_decode_graphs_serve_a_warm_turn_with_no_compile():
    model = make_tiny_model("qwen2")
    backend = CountingBackend()
    graphs = GraphedDecoder(model, GraphConfig(backend=backend))  # type: ignore[arg-type]
    store = ChunkStore(StoreConfig(1 << 24))
    torch._dynamo.reset()
    new_cache = reuse_caches(store, model, adapter=False)
    assert new_cache is not None
    result = graphs.warm_up(lambda: new_cache(()), [(1, 100), (1, 100, 20)], progress=False)
    assert result.warmed == ((1, 256), (1, 256, 32)) and backend.compiles == 2
    assert graphs.stats()["graphed_prefills"] == 0 and not store.tier("ram").items()  # nothing counted or stored
    prompts, rows, _ = chat(model, graphs, [0])
    expected = [reference(model, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts]
    assert [row.tokens for row in rows] == expected
    assert backend.compiles == 2 and graphs.graphed_prefills == 1  # the warm turn compiled nothing


def test_a_prefill_gets_the_capacity_its_answer_needs_and_runs_eagerly_where_its_padding_would_not_fit():
    graphs = GraphedDecoder(make_tiny_model("qwen2"), GraphConfig(max_capacity=1024))
    assert graphs.prefill_capacity(rows=3, held=100, queries=20, answer=4) == 256  # 124 tokens; 132 padded
    assert graphs.prefill_capacity(rows=1, held=240, queries=10, answer=100) == 512  # 350 tokens
    assert graphs.prefill_capacity(rows=1, held=230, queries=20, answer=4) is None  # 254 tokens, 262 padded
    assert graphs.prefill_capacity(rows=1, held=0, queries=20, answer=4) is None  # nothing reused: a cold prompt
    assert graphs.prefill_capacity(rows=1, held=100, queries=257, answer=4) is None  # above the query buckets
    assert graphs.prefill_capacity(rows=33, held=100, queries=20, answer=4) is None  # above the row buckets
    assert graphs.prefill_capacity(rows=1, held=1000, queries=20, answer=100) is None  # above max_capacity


def test_prefill_shapes_round_up_to_the_query_buckets():
    config = GraphConfig(max_capacity=4096)
    assert parse_graph_shapes("1x2048x40, 3x100x16, 1x2048", config) == ((1, 2048, 64), (4, 256, 16), (1, 2048))
    assert graph_shape(1, 10, config, 20) == (1, 256, 32)
    assert graph_shape(1, 300, config, 1) == (1, 512)  # one query: a decode step
    for bad in ("1x2048x300", "1x2048x", "1x2x3x4"):
        with pytest.raises(ConfigError):
            parse_graph_shapes(bad, config)


@pytest.mark.parametrize("buckets", [(1, 16), (32, 16), (16, 16)])
def test_graph_config_refuses_query_buckets_that_are_not_ascending_above_one(buckets):
    with pytest.raises(ConfigError, match="query_buckets"):
        GraphConfig(query_buckets=buckets)
