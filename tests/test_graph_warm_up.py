"""Decode, prefill and verify graphs warmed up ahead of requests (``GraphedDecoder.warm_up``,
``InferenceEngine.warm_up_graphs``, the server's ``warm_up_graphs`` setting): a later request of a warmed shape
compiles nothing, keeps transformers' generate() tokens, and the warm-up leaves the store as it found it.

Compiles are counted by a ``torch.compile`` backend of the test's own (dynamo calls a backend once per graph it
compiles), not by the decoder's counters."""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo
from conftest import make_tiny_model, noisy_copy
from helpers import CountingBackend, word_tokenizer, words
from oracle import engine_reference, reference

from kvboost_hf import KVBoost
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, VerifyShape, graph_shape, parse_graph_shapes
from kvboost_hf.hf.speculative import DraftConfig

EOS = 1  # word_tokenizer's <eos>


def counting_engine(draft: DraftConfig | None = None, **graph_options) -> tuple[KVBoost, CountingBackend]:
    """An engine on a tiny Qwen2 and the word tokenizer whose graphs compile through a counting backend; with
    ``draft``, speculative, drafting with a noisy copy of the target (often, not always, the target's choices)."""
    backend = CountingBackend()
    config = GraphConfig(backend=backend, **graph_options)  # type: ignore[arg-type]
    model = make_tiny_model("qwen2")
    speculative = {} if draft is None else {"draft_model": noisy_copy(model, 0.35, seed=11), "draft": draft}
    return KVBoost(model, word_tokenizer(), chunking=8, graphs=config, **speculative), backend


def store_snapshot(engine: KVBoost) -> tuple:
    """Everything a warm-up could leave in the store: its entries (key, tensors), LRU order and counters."""
    ram = engine.store.tier("ram")
    assert ram is not None
    entries = [(key, entry.keys.clone(), entry.values.clone()) for key, entry in sorted(ram.items())]
    return entries, ram.eviction_order(), engine.store.stats()


def same_snapshot(a: tuple, b: tuple) -> bool:
    (entries_a, order_a, stats_a), (entries_b, order_b, stats_b) = a, b
    same_entries = len(entries_a) == len(entries_b) and all(
        ka == kb and torch.equal(keys_a, keys_b) and torch.equal(values_a, values_b)
        for (ka, keys_a, values_a), (kb, keys_b, values_b) in zip(entries_a, entries_b, strict=True)
    )
    return same_entries and order_a == order_b and stats_a == stats_b


def test_graph_shapes_round_up_to_the_buckets():
    config = GraphConfig(row_buckets=(1, 2, 4, 8), max_capacity=4096)
    assert parse_graph_shapes(" 1x100, 3X4000,4x4096 ,", config) == ((1, 256), (4, 4096))
    assert parse_graph_shapes("", config) == ()
    assert graph_shape(5, 257, config) == (8, 512)
    for bad in ("4", "x256", "4x", "ax256", "0x256", "-1x256", "9x256", "1x4097"):
        with pytest.raises(ConfigError):
            parse_graph_shapes(bad, config)


def test_verify_shapes_are_named_with_v_and_kept_apart_from_prefills():
    """``ROWSxTOKENSvDRAFTS``: a verify shape (rows, capacity and draft tokens rounded up to their buckets, the
    capacity holding a column, the root and the drafts), a type of its own, listed beside a prefill of the same
    numbers."""
    config = GraphConfig(row_buckets=(1, 2, 4), draft_buckets=(2, 4, 16), max_capacity=4096)
    shapes = parse_graph_shapes("3x4000v3, 1x100v16, 1x100x16, 1X100V9", config)
    assert shapes == ((4, 4096, 4), (1, 256, 16), (1, 256, 16))  # the last entry is the second's shape again
    assert [type(shape) for shape in shapes] == [VerifyShape, VerifyShape, tuple]
    assert parse_graph_shapes("1x1v16", config) == ((1, 256, 16),)  # room for a column, the root and 16 nodes
    for bad in ("1v2", "1x2x3v2", "1x256v", "1x256vx", "1x256v0", "8x256v2", "1x256v17", "1x4097v2", "1x256v2v2"):
        with pytest.raises(ConfigError):
            parse_graph_shapes(bad, config)


def test_a_speculative_request_of_a_warmed_verify_shape_compiles_nothing_and_gives_generates_tokens():
    """An engine with a draft (chains of 3 draft tokens: bucket 4, then 2 and 1 near the answer's end: bucket 2)
    warms those for 1 row up: two compiles, both verify shapes reported warmed, the store unchanged (entries, LRU
    order, counters) and no verify counted; then a speculative request compiles nothing, runs every verify forward
    after its prompt graphed, and gives generate()'s tokens. Likewise a batch of three (the 4-row bucket, its
    padding row a copy of the last) down to fewer rows as they end, after warming 3 and 2 rows too."""
    engine, backend = counting_engine(DraftConfig(num_draft_tokens=3))
    texts = [words(seed, 20 + 3 * seed) for seed in range(3)]
    engine.warm(texts[0])  # the prompt's chunks in the store: something the warm-up must leave alone
    before = store_snapshot(engine)
    torch._dynamo.reset()
    result = engine.warm_up_graphs(engine.graph_shapes("1x200v3,1x200v2"), progress=False)
    assert result.warmed == (VerifyShape(1, 256, 4), VerifyShape(1, 256, 2)) and not result.skipped
    assert all(isinstance(shape, VerifyShape) for shape in result.warmed) and not result.failed
    assert backend.compiles == 2 and engine.graphs.state == "ready"
    assert same_snapshot(store_snapshot(engine), before)
    counts = [engine.cache_stats()[f"graph_{name}"] for name in ("graphed_verifies", "eager_verifies")]
    assert counts == [0, 0] and engine.cache_stats()["graph_warmed_verify_shapes"] == 2

    got = engine.generate(texts[0], max_new_tokens=12)
    assert backend.compiles == 2  # no compile in the request's path
    assert got.output_ids == engine_reference(engine, texts[0], 12).tokens
    stats = engine.cache_stats()
    assert stats["graph_graphed_verifies"] > 0 and stats["graph_eager_verifies"] == 0
    assert stats["graph_verify_shapes"] == 2 and stats["graph_failed_verify_shapes"] == 0

    assert (
        len(engine.warm_up_graphs(engine.graph_shapes("3x200v3,3x200v2,2x200v3,2x200v2"), progress=False).warmed) == 4
    )
    batch = engine.generate_batch(texts, max_new_tokens=12)
    assert backend.compiles == 6  # the batch's verify forwards compiled nothing
    assert [r.output_ids for r in batch] == [engine_reference(engine, t, 12).tokens for t in texts]
    assert engine.cache_stats()["graph_eager_verifies"] == 0
    assert (4, 256, 4) in engine.factories.verify_graphs.shapes  # the padded batch ran graphed


def test_verify_warm_up_respects_max_graphs_the_capture_cap_and_needs_a_draft():
    """Decode and verify graphs share ``max_graphs``; ``max_capture_bytes`` 0 leaves no room; an engine without a
    draft verifies nothing, so its verify shapes are skipped, compiling nothing."""
    chain = DraftConfig(num_draft_tokens=3)
    engine, backend = counting_engine(chain, max_graphs=2)
    torch._dynamo.reset()
    result = engine.warm_up_graphs([(1, 64), VerifyShape(1, 64, 3), VerifyShape(1, 64, 2)], progress=False)
    assert (result.warmed, result.skipped, backend.compiles) == (((1, 256), (1, 256, 4)), ((1, 256, 2),), 2)
    again = engine.warm_up_graphs([VerifyShape(1, 64, 4)], progress=False)  # graphed already
    assert (again.warmed, again.skipped, backend.compiles) == ((), ((1, 256, 4),), 2)
    late = engine.warm_up_graphs([(2, 64)], progress=False)  # a decode graph after the verify graph: no room either
    assert (late.warmed, late.skipped, backend.compiles) == ((), ((2, 256),), 2)
    for capped, capped_backend in (counting_engine(chain, max_capture_bytes=0), counting_engine()):
        torch._dynamo.reset()
        assert capped.warm_up_graphs([VerifyShape(1, 64, 3)], progress=False).skipped == ((1, 256, 4),)
        assert capped_backend.compiles == 0 and capped.cache_stats()["graph_warmed_verify_shapes"] == 0


def test_a_request_of_a_warmed_shape_compiles_nothing_and_gives_generates_tokens():
    """Warm-up of 1 row and of 3 rows (the 4-row graph), and of a 1-row prefill of up to 16 new tokens, compiles
    each once; then a request (its prompt warm: its short tail prefilled graphed) and a batch of three run graphed
    with no compile, their tokens generate()'s; the store is untouched by the warm-up (entries, LRU order, hit and
    miss counters), the step counters too."""
    engine, backend = counting_engine()
    texts = [words(seed, 20 + seed) for seed in range(3)]
    engine.warm(texts[0])  # something in the store for the warm-up to leave alone
    before = store_snapshot(engine)
    torch._dynamo.reset()
    assert engine.graphs.state == "lazy"
    shapes = [(1, 64), (3, 100), (1, 200), (1, 64, 9)]  # 1x200: the 1x256 graph again
    result = engine.warm_up_graphs(shapes, progress=False)
    assert result.warmed == ((1, 256), (4, 256), (1, 256, 16)) and not result.skipped and not result.failed
    assert backend.compiles == 3 and engine.graphs.state == "ready"
    assert same_snapshot(store_snapshot(engine), before)
    stats = engine.cache_stats()
    assert (stats["graph_graphed_steps"], stats["graph_eager_steps"], stats["generated_tokens"]) == (0, 0, 0)
    assert stats["graph_warmed_shapes"] == 3 and stats["graph_warm_up_seconds"] > 0

    alone = engine.generate(texts[0], max_new_tokens=8)
    batch = engine.generate_batch(texts, max_new_tokens=8)
    assert backend.compiles == 3  # no compile in the requests' path
    stats = engine.cache_stats()
    assert stats["graph_graphed_steps"] > 0 and stats["graph_eager_steps"] == 0
    assert stats["graph_graphed_prefills"] >= 1 and stats["graph_eager_prefills"] == 0
    expected = [reference(engine.model, engine.encode(t), 8, eos_token_ids={EOS}).tokens for t in texts]
    assert [alone.output_ids] + [r.output_ids for r in batch] == [expected[0], *expected]


def test_warm_up_respects_max_graphs_the_capture_cap_and_graphs_off():
    engine, backend = counting_engine(max_graphs=1)
    torch._dynamo.reset()
    result = engine.warm_up_graphs([(1, 64), (2, 64)], progress=False)
    assert (result.warmed, result.skipped, backend.compiles) == (((1, 256),), ((2, 256),), 1)
    again = engine.warm_up_graphs([(1, 64)], progress=False)  # graphed already: nothing to do
    assert (again.warmed, again.skipped, backend.compiles) == ((), ((1, 256),), 1)

    capped, capped_backend = counting_engine(max_capture_bytes=0)  # no memory for any graph
    assert capped.warm_up_graphs([(1, 64)], progress=False).skipped == ((1, 256),)
    assert capped_backend.compiles == 0 and capped.graphs.state == "ready"

    model = make_tiny_model("qwen2")
    off = GraphedDecoder(model, GraphConfig(enabled=False))
    assert off.warm_up(lambda: pytest.fail("no cache needed"), [(1, 64)], progress=False).skipped == ((1, 256),)
    assert off.state == "off"


def test_a_shape_whose_warm_up_compile_fails_runs_eagerly_later():
    def broken(graph_module, example_inputs):
        raise RuntimeError("no graphs here")

    engine = KVBoost(make_tiny_model("qwen2"), word_tokenizer(), chunking=8, graphs=GraphConfig(backend=broken))  # type: ignore[arg-type]
    torch._dynamo.reset()
    result = engine.warm_up_graphs([(1, 64)], progress=False)
    assert result.failed == ((1, 256),) and not result.warmed
    text = words(5, 20)
    got = engine.generate(text, max_new_tokens=6).output_ids
    assert got == reference(engine.model, engine.encode(text), 6, eos_token_ids={EOS}).tokens
    assert engine.cache_stats()["graph_graphed_steps"] == 0


def test_the_server_warms_its_graphs_up_before_health_reports_them_ready():
    """``ServerConfig(warm_up_graphs=...)``: the worker warms the graphs up at start, /health's ``decode_graphs``
    turns ``ready``; a completion of the warmed shape then compiles nothing."""
    from fastapi.testclient import TestClient

    from kvboost_hf.server.app import create_app
    from kvboost_hf.server.settings import ServerConfig

    engine, backend = counting_engine()
    torch._dynamo.reset()
    with pytest.raises(ConfigError):
        create_app(engine, ServerConfig(warm_up_graphs="64x1"))  # above the row buckets: refused before serving
    app = create_app(engine, ServerConfig(warm_up_graphs="1x64"))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while (state := client.get("/health").json()["decode_graphs"]) != "ready":
            assert state in ("lazy", "warming") and time.monotonic() < deadline
            time.sleep(0.05)
        assert backend.compiles == 1
        body = {"model": ServerConfig().model_name, "prompt": words(7, 20), "max_tokens": 6, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
    assert backend.compiles == 1 and engine.cache_stats()["graph_graphed_steps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_graphs_warmed_up_serve_requests_with_no_compile_and_generates_tokens_in_fp32():
    """Inductor with CUDA graphs (the default on CUDA): warm-up of 1 and 3 rows, then a request and a batch of three
    compile nothing (dynamo's graph counter) and give generate()'s fp32 tokens."""
    from torch._dynamo.utils import counters

    engine = KVBoost(make_tiny_model("qwen2").to("cuda"), word_tokenizer(), chunking=8, graphs=GraphConfig())
    texts = [words(seed, 20 + seed) for seed in range(3)]
    torch._dynamo.reset()
    result = engine.warm_up_graphs([(1, 64), (3, 64)], progress=False)
    assert result.warmed == ((1, 256), (4, 256)) and engine.cache_stats()["graph_capture_bytes"] >= 0
    compiled = counters["stats"]["unique_graphs"]
    outputs = [engine.generate(texts[0], max_new_tokens=8), *engine.generate_batch(texts, max_new_tokens=8)]
    assert counters["stats"]["unique_graphs"] == compiled
    expected = [reference(engine.model, engine.encode(t), 8, eos_token_ids={EOS}).tokens for t in texts]
    assert [output.output_ids for output in outputs] == [expected[0], *expected]
    assert engine.cache_stats()["graph_graphed_steps"] > 0 and engine.cache_stats()["graph_eager_steps"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_verify_graphs_warmed_up_serve_a_speculative_request_with_no_compile_in_fp32():
    """Inductor with CUDA graphs: verify shapes of a chain of 3 draft tokens (buckets 4 and 2) warmed up for 1 row,
    then a speculative request compiles nothing (dynamo's graph counter), runs its verifies graphed and gives
    generate()'s fp32 tokens."""
    from torch._dynamo.utils import counters

    model = make_tiny_model("qwen2")
    draft = noisy_copy(model, 0.35, seed=11).to("cuda")  # noise drawn on the CPU
    engine = KVBoost(model.to("cuda"), word_tokenizer(), chunking=8, graphs=GraphConfig(), draft_model=draft,
                     draft=DraftConfig(num_draft_tokens=3))  # fmt: skip
    text = words(3, 24)
    torch._dynamo.reset()
    result = engine.warm_up_graphs(engine.graph_shapes("1x200v3,1x200v2"), progress=False)
    assert result.warmed == (VerifyShape(1, 256, 4), VerifyShape(1, 256, 2))
    compiled = counters["stats"]["unique_graphs"]
    got = engine.generate(text, max_new_tokens=12)
    assert counters["stats"]["unique_graphs"] == compiled
    assert got.output_ids == engine_reference(engine, text, 12).tokens
    stats = engine.cache_stats()
    assert stats["graph_graphed_verifies"] > 0 and stats["graph_eager_verifies"] == 0
