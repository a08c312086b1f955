"""Graphed decode steps (``hf/graphs.py``): bucket logic, and graphed == eager == transformers' generate()."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import make_tiny_model
from helpers import DECODE_EOS, finish, new_loop, prefill, prefill_in_chunks, reuse_caches
from oracle import reference

from kvboost_hf import ChunkReuseCache, ChunkStore
from kvboost_hf.bench.profiling import SyncSites
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.hf.decode import DecodeRequest
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, capacity_bucket, pad_rows, row_bucket
from kvboost_hf.hf.prefill import forward
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.store.config import StoreConfig


@pytest.fixture(scope="module", autouse=True)
def graphs_shared_by_the_module():
    """Dynamo's caches emptied once, at the module's start, not per run: the 1- and 2-row graphs the runner's test
    compiles for a tiny Qwen2 serve the bucket test's (same class, same weights, as a request replays a warmed
    graph); the decoders count their own steps and shapes either way. The tests refusing a recompile or failing a
    compile reset for themselves (the failing one last)."""
    torch._dynamo.reset()


STEPS = 10
CAPACITY = 64


def test_row_bucket_is_the_smallest_that_holds_the_rows():
    buckets = (1, 2, 4, 8)
    assert [row_bucket(rows, buckets) for rows in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="at least one row"):
        row_bucket(0, buckets)


@pytest.mark.parametrize("buckets", [(), (0, 1), (4, 2), (2, 2)])
def test_graph_config_refuses_buckets_that_are_not_ascending_positive(buckets):
    with pytest.raises(ValueError, match="ascending distinct positive"):
        GraphConfig(row_buckets=buckets)


def test_pad_rows_repeats_the_last_row():
    rows = torch.tensor([[1, 2], [3, 4], [5, 6]])
    assert pad_rows(rows, 5).tolist() == [[1, 2], [3, 4], [5, 6], [5, 6], [5, 6]]
    assert pad_rows(rows, 3) is rows
    with pytest.raises(ValueError, match="cannot pad 3 rows down to 2"):
        pad_rows(rows, 2)


def test_rows_for_pads_to_a_bucket_only_when_graphs_run():
    model = make_tiny_model("llama")
    assert GraphedDecoder(model).rows_for(3) == 4
    assert GraphedDecoder(model, GraphConfig(row_buckets=(1, 2))).rows_for(3) == 3  # above the buckets: eager
    assert GraphedDecoder(model, GraphConfig(enabled=False)).rows_for(3) == 3


def decode_rows(model, decoder: GraphedDecoder, prompts: list[list[int]], static: bool, device="cpu") -> list:
    """Greedy tokens of ``prompts`` (left-padded into one batch, padded up to ``decoder.rows_for`` rows with a
    repeated last row) decoded by ``decoder`` over a static (or growing) cache; the real rows' tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    rows = decoder.rows_for(len(prompts))
    ids, mask = pad_rows(ids, rows), pad_rows(mask, rows)
    store = ChunkStore(StoreConfig(1 << 24))
    cache = ChunkReuseCache(
        store, model, 16, mode="baseline", adapter=False, write_back=False, max_cache_len=CAPACITY if static else None
    )
    out = forward(model, cache, input_ids=ids, attention_mask=mask, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    lengths = mask.sum(-1, keepdim=True)
    tokens = [token]
    for step in range(STEPS):
        logits = decoder.step(cache, token, lengths + step)
        cache.record(token)
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)[: len(prompts)].tolist()


PROMPTS = [list(range(3, 23)), list(range(40, 52)), list(range(90, 105))]


@pytest.mark.parametrize(
    ("config", "static", "graphed"),
    [
        (GraphConfig(backend="eager"), True, True),
        (GraphConfig(enabled=False), True, False),
        (GraphConfig(backend="eager"), False, False),  # a growing cache cannot be graphed
        (GraphConfig(row_buckets=(1, 2), backend="eager"), True, False),  # 3 rows: above the buckets
    ],
)
def test_graphed_and_eager_steps_give_generates_tokens(config, static, graphed):
    model = make_tiny_model("qwen2")
    expected = [reference(model, prompt, STEPS + 1).tokens for prompt in PROMPTS]
    decoder = GraphedDecoder(model, config)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert decode_rows(model, decoder, PROMPTS, static) == expected
    assert (decoder.graphed_steps, decoder.eager_steps) == ((STEPS, 0) if graphed else (0, STEPS))
    assert decoder.graph_shapes == ({(4, CAPACITY): STEPS} if graphed else {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("count", [1, 3])
def test_cuda_graphed_decoder_gives_the_eager_tokens_in_fp32(count):
    """CUDA graphs (inductor, reduce-overhead) per rows bucket: 1 row, and 3 rows padded to 4."""
    model = make_tiny_model("llama").to("cuda")
    prompts = PROMPTS[:count]
    eager = decode_rows(model, GraphedDecoder(model, GraphConfig(enabled=False)), prompts, True, "cuda")
    torch._dynamo.reset()
    decoder = GraphedDecoder(model)
    assert decode_rows(model, decoder, prompts, True, "cuda") == eager
    assert decoder.graphed_steps == STEPS and decoder.capture_bytes >= 0


def test_capacity_bucket_is_a_power_of_two_from_256_up_to_the_cap():
    config = GraphConfig(max_capacity=4096)
    assert [capacity_bucket(n, config) for n in (1, 256, 257, 1000, 4096, 4097)] == [256, 256, 512, 1024, 4096, None]
    with pytest.raises(ValueError, match="max_capacity"):
        GraphConfig(max_capacity=100)


def runner_decodes_graphed_through_joins_and_retirements(device: str, backend: str | None) -> None:
    """A reuse loop whose plain decode steps go through the graphs: one row graphed, a second joining (the cache
    grows back, then turns static again at 2 rows), a third prefilled in chunks while the two decode graphed, then
    making 3 rows (outside the buckets: the loop's eager forward), rows retiring at different lengths; every row's
    tokens are transformers' greedy generate()'s."""
    model = make_tiny_model("qwen2").to(device)
    prompts = {(*PROMPTS[0],): 9, (*PROMPTS[1],): 8, tuple(range(60, 75)): 3}  # prompt -> max_new_tokens
    requests = [
        DecodeRequest(prompt_ids=list(p), max_new_tokens=n, sampling=SamplingConfig(temperature=0))
        for p, n in prompts.items()
    ]
    expected = [reference(model, p, n, eos_token_ids=DECODE_EOS).tokens for p, n in prompts.items()]
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1, 2), backend=backend))
    loop = new_loop(model, reuse_caches(ChunkStore(StoreConfig(1 << 24)), model), graphs=decoder)
    prefill(loop, requests[:1])
    loop.step()
    loop.step()
    assert (decoder.graphed_steps, decoder.eager_steps) == (2, 0)
    prefill(loop, requests[1:2])
    loop.step()  # two rows: static again, graphed
    assert decoder.graphed_steps == 3 and set(decoder.graph_shapes) == {(1, 256), (2, 256)}
    assert prefill_in_chunks(loop, requests[2:], columns=4) == 3  # 15 columns in 4 calls, a graphed step after 3
    assert decoder.graphed_steps == 6 and len(loop.running) == 3
    loop.step()  # three rows: above the buckets, the loop's eager forward
    assert decoder.graphed_steps == 6
    finish(loop)
    assert [row.tokens for row in loop.rows] == expected
    assert decoder.graphed_steps > 3 and not decoder.failed_shapes


def test_the_runner_decodes_graphed_through_joins_and_retirements_with_generates_tokens():
    runner_decodes_graphed_through_joins_and_retirements("cpu", "eager")  # traced, no code generation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("backend", [None, "cudagraphs"])
def test_the_runner_decodes_cuda_graphed_with_generates_tokens_in_fp32(backend):
    torch._dynamo.reset()
    runner_decodes_graphed_through_joins_and_retirements("cuda", backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize(
    ("sampling", "waits"),
    [(SamplingConfig(temperature=0), 1), (SamplingConfig(temperature=0.8, top_p=0.9, seed=3), 2)],
    ids=["greedy", "sampled"],
)
def test_a_graphed_decode_step_synchronises_once_for_its_sampled_ids(sampling, waits):
    """The runner's graphed plain step: the tokens fed reach the device without a wait, the cache records the
    host's copy, write-back skips rows with no complete chunk, and the chunk the step completes lands in pinned RAM
    by an asynchronous copy (an H200 run saw its two blocking copies), so the sampled ids' transfer is the step's
    one synchronisation; a row drawing with its own generator adds one, its probabilities' transfer (every such row
    of the step in it: each row used to wait twice)."""
    model = make_tiny_model("qwen2").to("cuda")
    request = DecodeRequest(prompt_ids=PROMPTS[0], max_new_tokens=12, sampling=sampling)
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1,)))
    store = ChunkStore(StoreConfig(1 << 24))
    loop = new_loop(model, reuse_caches(store, model), graphs=decoder)
    torch._dynamo.reset()
    prefill(loop, [request])
    for _ in range(3):  # compile, capture, replay
        loop.step()
    torch.cuda.synchronize()
    puts = store.stats()["puts"]  # the 4th step completes the chunk of tokens 16-23 (8-token chunks, 20 prompted)
    with SyncSites() as syncs:  # the Python stack of each synchronising call (an H200 run saw 3: where they are)
        loop.step()
    assert decoder.graphed_steps == 4 and len(syncs.stacks) == waits, syncs.report()
    assert store.stats()["puts"] == puts + 1 and store.pin_memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_the_chunks_graphed_steps_write_back_land_in_pinned_ram_bit_for_bit():
    """Every chunk a graphed decode loop writes back (prompt chunks, chunks its steps complete, its tail) lands in
    one page-locked block per chunk, by asynchronous copies, holding exactly the device K/V it was put with once the
    store flushed."""
    model = make_tiny_model("qwen2").to("cuda")
    request = DecodeRequest(prompt_ids=PROMPTS[0], max_new_tokens=12, sampling=SamplingConfig(temperature=0))
    store = ChunkStore(StoreConfig(1 << 24))
    computed: dict[str, ChunkKV] = {}
    put = store.put

    def recording_put(key: str, entry: ChunkKV) -> None:
        computed[key] = ChunkKV(entry.keys.clone(), entry.values.clone())  # on the device, ordered before the copy
        put(key, entry)

    store.put = recording_put  # type: ignore[method-assign]
    loop = new_loop(model, reuse_caches(store, model), graphs=GraphedDecoder(model, GraphConfig(row_buckets=(1,))))
    torch._dynamo.reset()
    prefill(loop, [request])
    finish(loop)
    store.flush()
    assert store.pin_memory and store.stats()["landing"] == 0 and len(computed) >= 4  # 3 chunks and the tail
    for key, entry in computed.items():
        held = store.ram.get(key)
        assert isinstance(held, ChunkKV) and held.keys.is_pinned(), key
        assert held.keys.untyped_storage().data_ptr() == held.values.untyped_storage().data_ptr()  # one block
        assert torch.equal(held.keys, entry.keys.cpu()) and torch.equal(held.values, entry.values.cpu()), key


def decode_across_buckets(model, requests, graphs: GraphedDecoder | None) -> tuple[list[list[int]], list, list]:
    """Rows joining and retiring across row buckets in one reuse loop: two rows, a third joining (3 rows: the
    4-row bucket), two more joining (5 rows: the 8-row bucket), then retiring at their budgets down to one.
    Returns every row's tokens, the store's chunks (key, entry) by key, and the rows running before each step."""
    store = ChunkStore(StoreConfig(1 << 24))
    loop = new_loop(model, reuse_caches(store, model), graphs=graphs)
    running = []
    for joining, steps in ((requests[:2], 1), (requests[2:3], 2), (requests[3:], 0)):
        prefill(loop, joining)
        for _ in range(steps):
            running.append(len(loop.running))
            loop.step()
    while not loop.done:
        running.append(len(loop.running))
        loop.step()
    store.flush()  # on CUDA, chunks written back last may still be landing
    ram = store.tier("ram")
    assert ram is not None
    return [row.tokens for row in loop.rows], sorted(ram.items(), key=lambda item: item[0]), running


def rows_between_buckets_decode_through_the_larger_graph(device: str, backend: str | None) -> None:
    """3 rows decode through the 4-row graph and 5 through the 8-row one (padding rows copy the last row, their
    logits dropped), across joins and retirements: every row's tokens are generate()'s; the chunks written back are,
    key for key, those of graphs with a bucket for every batch size (no padding row ever) and of the eager runner,
    equal up to fp32 rounding (not bit for bit: a matrix product's rows on this CPU change in their last bits with
    the row count, 4 and 5 rows against 2 and 3, and a static cache attends over its whole capacity, masked)."""
    model = make_tiny_model("qwen2").to(device)
    budgets = [12, 10, 9, 7, 5]
    prompts = [PROMPTS[0], PROMPTS[1], list(range(100, 118)), list(range(60, 75)), list(range(20, 33))]
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=n, sampling=SamplingConfig(temperature=0))
        for p, n in zip(prompts, budgets, strict=True)
    ]
    expected = [reference(model, p, n, eos_token_ids=DECODE_EOS).tokens for p, n in zip(prompts, budgets, strict=True)]
    padded = GraphedDecoder(model, GraphConfig(backend=backend))
    unpadded = GraphedDecoder(model, GraphConfig(row_buckets=tuple(range(1, 9)), backend=backend))
    tokens, chunks, running = decode_across_buckets(model, requests, padded)
    exact_tokens, exact_chunks, exact_running = decode_across_buckets(model, requests, unpadded)
    eager_tokens, eager_chunks, _ = decode_across_buckets(model, requests, None)
    assert tokens == exact_tokens == eager_tokens == expected
    assert 3 in running and 5 in running and running == exact_running  # the padded batches did run
    assert padded.eager_steps == 0 and not padded.failed_shapes and padded.graphed_steps == len(running)
    assert {rows for rows, _ in padded.graph_shapes} == {1, 2, 4, 8}
    assert [key for key, _ in chunks] == [key for key, _ in exact_chunks] == [key for key, _ in eager_chunks]
    assert chunks
    for (_, entry), *others in zip(chunks, exact_chunks, eager_chunks, strict=True):
        for _, other in others:
            assert torch.allclose(entry.keys, other.keys, rtol=0, atol=1e-5)
            assert torch.allclose(entry.values, other.values, rtol=0, atol=1e-5)


def test_rows_between_buckets_decode_through_the_larger_graph_with_generates_tokens_and_unpadded_write_back():
    rows_between_buckets_decode_through_the_larger_graph("cpu", "eager")  # traced, no code generation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_rows_between_buckets_decode_through_the_larger_cuda_graph_with_generates_tokens_in_fp32():
    torch._dynamo.reset()
    rows_between_buckets_decode_through_the_larger_graph("cuda", None)  # inductor, reduce-overhead


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_graphed_decode_under_kvboost_attention_runs_graphed_near_the_eager_logits():
    """A bf16 model under ``attn_implementation="kvboost"``: the default graphs (inductor, CUDA graphs) capture
    decode steps whose attention is the Triton kernel's custom op over the static capacity. On an H200 every such
    shape failed to compile (dynamo refused the attention function) and ran eagerly. Every step runs graphed, its
    logits within bf16 rounding of the eager steps'."""
    model = make_tiny_model("qwen2").to("cuda", torch.bfloat16)
    model.set_attn_implementation("kvboost")
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    steps = 6

    def decode(decoder: GraphedDecoder) -> torch.Tensor:
        cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 24)), model, 16, mode="baseline", adapter=False,
                                write_back=False, max_cache_len=CAPACITY)  # fmt: skip
        logits = []
        with torch.inference_mode():
            token = forward(model, cache, input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for step in range(steps):
                position = torch.tensor([[ids.shape[1] + step]], device="cuda")
                logits.append(decoder.step(cache, token, position).float())
                cache.record(token.cpu())
                token = logits[-1].argmax(-1, keepdim=True)
        return torch.cat(logits)

    torch._dynamo.reset()
    expected = decode(GraphedDecoder(model, GraphConfig(enabled=False)))
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1,)))
    graphed = decode(decoder)
    assert (decoder.graphed_steps, decoder.failed_shapes) == (steps, set())
    assert (graphed - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_every_decoder_adds_its_graphs_to_dynamos_one_limit(monkeypatch):
    """Dynamo's ``recompile_limit`` counts compiles per code object, and transformers' models share one ``forward``
    code object (its decorator's wrapper): two decoders of 6 graphs each (a target and its draft) need a limit of 12
    at least, where each raising it to its own 6 left it at 8 and the 9th graph compiled nothing (eager, "failed")."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    target, draft = make_tiny_model("qwen2"), make_tiny_model("llama")
    assert target.forward.__func__.__code__ is draft.forward.__func__.__code__  # one code object for dynamo
    for model in (target, draft):
        GraphedDecoder(model, GraphConfig(max_graphs=6))._graph()
    assert torch._dynamo.config.recompile_limit >= 12


def test_a_shape_whose_compile_fails_runs_eagerly_with_the_same_tokens(caplog):
    def broken(graph_module, example_inputs):
        raise RuntimeError("no graphs here")

    model = make_tiny_model("qwen2")
    expected = [reference(model, prompt, STEPS + 1).tokens for prompt in PROMPTS[:1]]
    decoder = GraphedDecoder(model, GraphConfig(backend=broken))  # type: ignore[arg-type]
    torch._dynamo.reset()
    assert decode_rows(model, decoder, PROMPTS[:1], True) == expected
    assert decoder.failed_shapes == {(1, CAPACITY)} and decoder.graphed_steps == 0
    assert decoder.eager_steps == STEPS and "runs eagerly" in caplog.text
