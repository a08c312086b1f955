"""Graphed verify forwards of speculative decoding (``hf/verify_graphs.py``): chain and tree drafts, one row and
several (padded to a row bucket), through graphs on a static cache give transformers' generate() tokens and the
eager run's accepted drafts; one graph serves every draft count within its bucket (compiles counted by a backend of
the test's own)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch._dynamo
from conftest import make_tiny_model, noisy_copy
from helpers import (
    DECODE_EOS,
    CountingBackend,
    finish,
    new_loop,
    prefill,
    reuse_caches,
    word_tokenizer,
    words,
)
from oracle import engine_reference, reference

from kvboost_hf import ChunkStore, KVBoost, SamplingConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, draft_bucket
from kvboost_hf.hf.speculative import DraftConfig, Drafter
from kvboost_hf.hf.verify_graphs import GraphedVerifier
from kvboost_hf.store.config import StoreConfig


@pytest.fixture(scope="module", autouse=True)
def graphs_shared_by_the_module():
    """Dynamo's caches emptied once, at the module's start, not per test: a verify shape an earlier test compiled on
    the shared ``target`` replays that graph (as a request replays a warmed one), so each of the module's 8 shapes
    compiles once; the verifiers count their own verifies and shapes either way. Dynamo's graphs of every model's
    ``forward`` count against one limit (one transformers wrapper; each decoder raises it by its ``max_graphs``):
    the benchmark resets before compiling its model's, and the test counting compiles resets and runs last."""
    torch._dynamo.reset()


CHAIN = DraftConfig(num_draft_tokens=3)
TREE = DraftConfig(num_draft_tokens=3, tree_budget=6, tree_branching=2)
NEW_TOKENS = 14
GREEDY = SamplingConfig(temperature=0)


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(2, 120, (n,), generator=generator).tolist() for n in (17, 9, 23)[:count]]


def speculate(
    target, draft, settings, texts, verifier: GraphedVerifier | None, sampling: SamplingConfig = GREEDY
) -> DecodeLoop:
    """Speculative decoding of ``texts`` (greedy by default) in one loop over chunk-reuse caches (target and draft),
    its verify forwards through ``verifier`` (None: eager)."""
    store = ChunkStore(StoreConfig(1 << 24))
    drafter = Drafter(draft, settings, reuse_caches(store, draft, adapter=False))
    loop = new_loop(target, reuse_caches(store, target, adapter=False), draft=drafter, verify_graphs=verifier)
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, sampling=sampling) for p in texts])
    return finish(loop)


def test_draft_bucket_is_the_smallest_that_holds_the_nodes():
    buckets = (2, 4, 8)
    assert [draft_bucket(nodes, buckets) for nodes in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, None]
    for bad in [(0, 2), (4, 2), (2, 2)]:
        with pytest.raises(ConfigError, match="draft_buckets"):
            GraphConfig(draft_buckets=bad)


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("count", [1, 3])
def test_graphed_verify_gives_generates_tokens_and_the_eager_acceptance(target, draft, settings, count):
    """1 row, and 3 rows padded to the 4-row bucket (then fewer as rows end): every verify forward of the
    speculative steps runs graphed (chain: 3 draft tokens padded to 4; tree: 6 nodes padded to 8, and fewer near
    the budget's end), the tokens are generate()'s and each row accepts the same drafts in the same rounds as the
    eager run."""
    texts = prompts(count)
    expected = [reference(target, p, NEW_TOKENS, eos_token_ids=DECODE_EOS).tokens for p in texts]
    eager = speculate(target, draft, settings, texts, None)
    verifier = GraphedVerifier(GraphedDecoder(target, GraphConfig(backend="eager")))
    buffers = []  # per graphed verify: (layer rows, capacity), the first layer's key buffer address
    run = verifier.run

    def recording(cache, *args):
        logits = run(cache, *args)
        buffers.append(((cache.layers[0].keys.shape[0], cache.max_cache_len), cache.layers[0].keys.data_ptr()))
        return logits

    verifier.run = recording  # type: ignore[method-assign]
    graphed = speculate(target, draft, settings, texts, verifier)
    assert [row.tokens for row in graphed.rows] == expected == [row.tokens for row in eager.rows]
    assert [row.draft_rounds for row in graphed.rows] == [row.draft_rounds for row in eager.rows]
    assert sum(row.draft_accepted for row in graphed.rows) > 0  # the draft is worth verifying at all
    steps = graphed.verify_forwards - 1  # the prompt forward verified the first tree, eagerly
    assert (verifier.graphed_verifies, verifier.eager_verifies) == (steps, 0) and steps > 0
    assert graphed.forwards == eager.forwards and not verifier.failed
    # the static buffers stay in place from one verify to the next while the rows' bucket and capacity hold
    assert all(
        address == following for (shape, address), (same, following) in itertools.pairwise(buffers) if shape == same
    )
    buckets = {bucket for bucket, _, _ in verifier.shapes}  # rows retire at different lengths: smaller buckets
    assert (buckets == {1}) if count == 1 else (4 in buckets)
    assert {drafts for _, _, drafts in verifier.shapes} <= {2, 4, 8}


def test_rows_joining_and_leaving_a_graphed_speculative_batch_keep_generates_tokens(target, draft):
    """One row decodes graphed (1-row graphs), two join mid-generation (the static cache grows back for the join,
    then 3 rows verify through the 4-row graphs), rows leave at different lengths (2, then 1): every row's tokens
    are generate()'s, and the chunks written back are exact (a longer prompt loading them gets a full prefill's
    first logits)."""
    first, *later = prompts(3)
    store = ChunkStore(StoreConfig(1 << 24))
    verifier = GraphedVerifier(GraphedDecoder(target, GraphConfig(backend="eager")))
    drafter = Drafter(draft, CHAIN, reuse_caches(store, draft, adapter=False))
    loop = new_loop(target, reuse_caches(store, target, adapter=False), draft=drafter, verify_graphs=verifier)
    prefill(loop, [DecodeRequest(prompt_ids=first, max_new_tokens=NEW_TOKENS, sampling=GREEDY)])
    loop.step()
    assert verifier.graphed_verifies == 1
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS + 4, sampling=GREEDY) for p in later])
    finish(loop)
    for row, prompt in zip(loop.rows, [first, *later], strict=True):
        assert row.tokens == reference(target, prompt, row.request.max_new_tokens, eos_token_ids=DECODE_EOS).tokens
    assert 4 in {bucket for bucket, _, _ in verifier.shapes} and verifier.eager_verifies == 0
    longer = [*first, *loop.rows[0].tokens, 5, 6, 7]
    request = DecodeRequest(prompt_ids=longer, max_new_tokens=1, sampling=GREEDY, keep_first_logits=True)
    plain, loaded = new_loop(target), new_loop(target, reuse_caches(store, target, adapter=False))
    for each in (plain, loaded):
        prefill(each, [request])
    assert loaded.rows[0].reuse is not None and loaded.rows[0].reuse.cached_tokens > len(first)  # answer chunks too
    assert torch.allclose(loaded.rows[0].first_logits, plain.rows[0].first_logits, atol=1e-4)


def test_seeded_sampled_rows_draw_the_same_tokens_graphed_and_eager(target, draft):
    """Rows sampled with a seed (temperature, top-k, a penalty: their own processors on the verify logits) beside a
    greedy row: the graphed verify's logits are the eager one's, so every draw is the same."""
    texts = prompts(3)
    sampling = SamplingConfig(temperature=0.9, top_k=30, presence_penalty=0.3, seed=1234)
    eager = speculate(target, draft, TREE, texts, None, sampling)
    verifier = GraphedVerifier(GraphedDecoder(target, GraphConfig(backend="eager")))
    graphed = speculate(target, draft, TREE, texts, verifier, sampling)
    assert [row.tokens for row in graphed.rows] == [row.tokens for row in eager.rows]
    assert [row.draft_rounds for row in graphed.rows] == [row.draft_rounds for row in eager.rows]
    assert verifier.graphed_verifies == graphed.verify_forwards - 1 > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_cuda_graphed_verify_gives_the_eager_tokens_in_fp32(settings):
    """Inductor with CUDA graphs (the default backend on CUDA): 3 rows padded to 4, chain and tree drafts, the tokens
    and acceptance of the eager verify."""
    target = make_tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.35, seed=11).to("cuda")  # noise drawn on the CPU
    target.to("cuda")
    texts = prompts(3)
    eager = speculate(target, draft, settings, texts, None)
    verifier = GraphedVerifier(GraphedDecoder(target))
    torch._dynamo.reset()
    graphed = speculate(target, draft, settings, texts, verifier)
    assert [row.tokens for row in graphed.rows] == [row.tokens for row in eager.rows]
    assert [row.draft_rounds for row in graphed.rows] == [row.draft_rounds for row in eager.rows]
    assert verifier.graphed_verifies == graphed.verify_forwards - 1 and not verifier.failed


def test_shapes_outside_the_buckets_run_eagerly_with_the_same_tokens(target, draft):
    """Graphs off: every verify forward eager (counted). Rows above the largest row bucket: eager while 3 rows run,
    graphed once a row ended. Draft tokens above the largest bucket: 3-token rounds eager, the shorter rounds near
    the rows' budgets graphed. The cache turns growing and static again in between; generate()'s tokens each
    time."""
    texts = prompts(3)
    expected = [reference(target, p, NEW_TOKENS, eos_token_ids=DECODE_EOS).tokens for p in texts]
    for config, graphs in (
        (GraphConfig(enabled=False), False),
        (GraphConfig(backend="eager", row_buckets=(1, 2)), True),  # 3 rows eager, then 2 graphed
        (GraphConfig(backend="eager", draft_buckets=(2,)), True),  # 3 draft tokens eager, 1 or 2 graphed
    ):
        verifier = GraphedVerifier(GraphedDecoder(target, config))
        loop = speculate(target, draft, CHAIN, texts, verifier)
        assert [row.tokens for row in loop.rows] == expected
        assert verifier.graphed_verifies + verifier.eager_verifies == loop.verify_forwards - 1
        assert verifier.eager_verifies > 0 and (verifier.graphed_verifies > 0) == graphs


def test_an_engine_verifies_graphed_with_generates_tokens_and_counts_it(target, draft):
    """An engine with a draft and graphs on (backend "eager"): a warm batch of two prompts and a lone prompt give
    transformers' greedy tokens; ``cache_stats()`` counts the verify forwards run graphed, none failed."""
    engine = KVBoost(target, word_tokenizer(), chunking=16, draft_model=draft, draft=TREE,
                     graphs=GraphConfig(backend="eager"))  # fmt: skip
    texts = [words(3, 30), words(4, 22)]
    engine.generate(texts[0], max_new_tokens=4)  # the first prompt's chunks stored: the batch below is warm
    batch = engine.generate_batch(texts, max_new_tokens=NEW_TOKENS)
    alone = engine.generate(texts[1], max_new_tokens=NEW_TOKENS)
    assert [r.output_ids for r in batch] == [engine_reference(engine, t, NEW_TOKENS).tokens for t in texts]
    assert alone.output_ids == batch[1].output_ids and batch[0].cached_tokens > 0
    stats = engine.cache_stats()
    assert stats["graph_graphed_verifies"] > 0 and stats["graph_verify_shapes"] >= 2  # 2 rows, then 1
    assert stats["graph_failed_verify_shapes"] == 0


def test_the_speculative_benchmark_runs_each_draft_eager_and_graphed_side_by_side(tmp_path):
    """``bench speculative --graphs both`` on the tiny random shape (CPU: backend "eager"): a ``copy`` row per draft
    length with every verify forward eager, a ``copy+graphs`` row with every one graphed, both with the plain
    greedy tokens; the report shows the graphed share."""
    from kvboost_hf.bench import speculative

    argv = ["--random-shape", "tiny", "--drafts", "copy", "--draft-lengths", "2,3", "--prompts", "1"]
    torch._dynamo.reset()  # room for the bench model's graphs: the module's verify shapes fill dynamo's 8 per forward
    assert speculative.main([*argv, "--max-new-tokens", "8", "--graphs", "both", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "speculative.json").read_text())
    rows = result["rows"]["resident"]
    assert result["graphs"] == "both" and [row["draft_tokens"] for row in rows["copy+graphs"]] == [2, 3]
    for kind, graphed in (("copy", False), ("copy+graphs", True)):
        for row in rows[kind]:
            verifies = row["graphed_verifies"] + row["eager_verifies"]
            assert row["outputs_identical"] and verifies > 0
            assert row["graphed_verifies"] == (verifies if graphed else 0)
    assert "100%" in speculative.report(result).split("copy+graphs")[1]


def test_one_graph_serves_every_draft_count_of_its_bucket(target, draft):
    """Chains of 3 and then 4 draft tokens (bucket 4), and of 2 (bucket 2) on the same graphs: two compiles, not
    three; the tokens are generate()'s."""
    backend = CountingBackend()
    verifier = GraphedVerifier(GraphedDecoder(target, GraphConfig(backend=backend)))  # type: ignore[arg-type]
    texts = prompts(1)
    expected = reference(target, texts[0], NEW_TOKENS, eos_token_ids=DECODE_EOS).tokens
    torch._dynamo.reset()
    for depth in (3, 4, 2):
        loop = speculate(target, draft, DraftConfig(num_draft_tokens=depth), texts, verifier)
        assert loop.rows[0].tokens == expected
    assert {drafts for _, _, drafts in verifier.shapes} == {2, 4}
    assert backend.compiles == 2 and verifier.eager_verifies == 0
