"""Decode steps launched ahead (``DecodeLoop(look_ahead=True)``, ``GraphConfig.look_ahead``): the next graphed step
of greedy rows runs on the device while the host takes the last step's tokens. On a CPU nothing overlaps, but every
token, log-probability and stored chunk must be what the loop gives without it, through joins, chunked prefills,
rows leaving early and rows that cannot look ahead."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import make_tiny_model
from helpers import DECODE_EOS, finish, new_loop, prefill, prefill_in_chunks, reuse_caches
from oracle import reference
from transformers import AutoTokenizer

from kvboost_hf import ChunkStore, InferenceEngine
from kvboost_hf.bench.profiling import SyncSites
from kvboost_hf.bench.shapes import tokenizer_dir
from kvboost_hf.hf.decode import DecodeRequest
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.store.config import StoreConfig


@pytest.fixture(scope="module", autouse=True)
def graphs_shared_by_the_module():
    """Dynamo's caches emptied once, at the module's start, not per run: the 1- and 2-row decode graphs the first run
    compiled for a tiny Qwen2 serve every later run's (same class, same weights: the run looking ahead replays the
    graphs of the one that does not, as a request replays a warmed graph); the loops count their own steps ahead and
    forwards either way."""
    torch._dynamo.reset()


GREEDY = SamplingConfig(temperature=0)
PROMPTS = {(*range(3, 23),): 9, (*range(40, 52),): 8, (*range(60, 75),): 3}  # prompt -> max_new_tokens


def requests(sampling=GREEDY, top_logprobs=None) -> list[DecodeRequest]:
    return [
        DecodeRequest(prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, top_logprobs=top_logprobs)
        for prompt, n in PROMPTS.items()
    ]


def store_contents(store: ChunkStore) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {key: (entry.keys.clone(), entry.values.clone()) for key, entry in store.ram.items()}


def joins_and_retirements(look_ahead: bool, work: list[DecodeRequest], device: str = "cpu", backend="eager"):
    """One row decoding graphed, a second joining, a third prefilled in chunks while they decode, three rows (above
    the 2-row bucket: eager, nothing launched ahead), rows leaving at 3, 8 and 9 tokens: the loop and its store."""
    model = make_tiny_model("qwen2").to(device)
    store = ChunkStore(StoreConfig(1 << 24))
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1, 2), backend=backend))
    loop = new_loop(model, reuse_caches(store, model), graphs=decoder, look_ahead=look_ahead)
    prefill(loop, work[:1])
    loop.step()
    loop.step()
    prefill(loop, work[1:2])  # a join cuts the step ahead off
    loop.step()
    prefill_in_chunks(loop, work[2:], columns=4)
    finish(loop)
    return loop, store


def test_steps_ahead_give_the_tokens_and_stored_chunks_of_the_loop_without_them():
    """Rows end by their budget and, the second one, by a stop token at its 4th or 5th token (a step ahead of it is
    then cut off before its chunks are stored)."""
    model = make_tiny_model("qwen2")
    expected = [reference(model, list(p), n, eos_token_ids=DECODE_EOS).tokens for p, n in PROMPTS.items()]
    stop = next(i for i in range(3, 5) if expected[1][i] not in expected[1][:i])  # while 2 rows decode graphed
    expected[1] = expected[1][: stop + 1]
    work = requests()
    ends = SamplingConfig(temperature=0, stop_token_ids=(expected[1][-1],))
    work[1] = DecodeRequest(prompt_ids=work[1].prompt_ids, max_new_tokens=8, sampling=ends)
    plain, plain_store = joins_and_retirements(False, work)
    ahead, ahead_store = joins_and_retirements(True, work)
    assert [row.tokens for row in plain.rows] == [row.tokens for row in ahead.rows] == expected
    assert [row.finish_reason for row in ahead.rows] == ["length", "stop", "length"]
    assert (plain.steps_ahead, plain.steps_ahead_dropped) == (0, 0)
    assert ahead.steps_ahead > ahead.steps_ahead_dropped >= 3  # the join, a chunk of the third prompt, the stop
    assert ahead.forwards == plain.forwards + ahead.steps_ahead_dropped  # a step cut off was run, then run again
    before, after = store_contents(plain_store), store_contents(ahead_store)
    assert before.keys() == after.keys() and before
    for key, (keys, values) in before.items():
        assert torch.equal(keys, after[key][0]) and torch.equal(values, after[key][1]), key


def test_rows_asking_for_log_probabilities_get_the_same_ones_ahead():
    plain, _ = joins_and_retirements(False, requests(top_logprobs=2))
    ahead, _ = joins_and_retirements(True, requests(top_logprobs=2))
    assert ahead.steps_ahead > 0
    assert [row.logprobs for row in ahead.rows] == [row.logprobs for row in plain.rows]
    assert all(len(row.logprobs) == len(row.tokens) for row in ahead.rows)


def test_a_row_that_samples_or_takes_its_last_token_launches_nothing_ahead():
    """A sampled row's choice is drawn on the host (its token cannot feed the device first); a row's last token
    ends it, so a step after it would be cut off."""
    sampled = SamplingConfig(temperature=0.7, seed=1)
    loop, _ = joins_and_retirements(True, [*requests()[:1], *requests(sampling=sampled)[1:]])
    assert loop.steps_ahead == 2  # the first row alone, at its 2nd and 3rd token; never beside the sampled row
    model = make_tiny_model("qwen2")
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1,), backend="eager"))
    one = new_loop(model, reuse_caches(ChunkStore(StoreConfig(1 << 24)), model), graphs=decoder, look_ahead=True)
    prefill(one, [DecodeRequest(prompt_ids=list(range(3, 23)), max_new_tokens=3, sampling=GREEDY)])
    finish(one)
    assert one.steps_ahead == 1 and one.steps_ahead_dropped == 0  # after token 1 (for token 3), not after token 2


def test_graph_config_looks_ahead_on_cuda_by_default_and_refuses_other_values():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not GraphConfig().looks_ahead(cpu) and GraphConfig().looks_ahead(cuda)
    assert GraphConfig(look_ahead=True).looks_ahead(cpu) and not GraphConfig(look_ahead=False).looks_ahead(cuda)
    assert not GraphConfig(enabled=False, look_ahead=True).looks_ahead(cpu)  # no graphs: nothing launched ahead
    with pytest.raises(ValueError, match="look_ahead"):
        GraphConfig(look_ahead="yes")  # type: ignore[arg-type]


def test_an_engine_looking_ahead_answers_as_one_that_does_not():
    """The whole path (scheduler, stop strings, different lengths, a batch whose rows end at different steps):
    the same texts, tokens and finish reasons; the steps launched ahead and those cut off in ``cache_stats()``."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    prompts = ["The first prompt is here", "A second, longer prompt about other things entirely", "Third"]
    results, stats = [], []
    for look_ahead in (False, True):
        graphs = GraphConfig(backend="eager", look_ahead=look_ahead)
        engine = InferenceEngine(model, tokenizer, chunking=16, graphs=graphs, store=ChunkStore(StoreConfig(1 << 26)))
        first = engine.generate_batch(prompts, max_new_tokens=12)
        stop = engine.tokenizer.decode(first[1].output_ids[4:6], skip_special_tokens=True)
        again = engine.generate_batch(prompts, max_new_tokens=12, stop=[stop] if stop.strip() else None)
        results.append([(r.output_text, r.output_ids, r.finish_reason) for r in (*first, *again)])
        stats.append(engine.cache_stats())
    assert results[0] == results[1]
    assert stats[0]["steps_ahead"] == 0 and stats[1]["steps_ahead"] > stats[1]["steps_ahead_dropped"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_graphed_steps_ahead_give_the_serial_tokens_and_wait_only_for_their_ids():
    """On CUDA (inductor, CUDA graphs, fp32): the joins-and-retirements run gives the same tokens with and without
    steps ahead; a steady step ahead waits for its own ids only (the event after their copy; no other
    synchronisation, which would also wait for the step launched behind them)."""
    plain, _ = joins_and_retirements(False, requests(), "cuda", None)
    ahead, _ = joins_and_retirements(True, requests(), "cuda", None)
    assert [row.tokens for row in ahead.rows] == [row.tokens for row in plain.rows] and ahead.steps_ahead > 0
    model = make_tiny_model("qwen2").to("cuda")
    decoder = GraphedDecoder(model, GraphConfig(row_buckets=(1,)))
    loop = new_loop(model, reuse_caches(ChunkStore(StoreConfig(1 << 24)), model), graphs=decoder, look_ahead=True)
    torch._dynamo.reset()
    prefill(loop, [DecodeRequest(prompt_ids=list(range(3, 23)), max_new_tokens=12, sampling=GREEDY)])
    for _ in range(4):  # compile, capture, replay
        loop.step()
    torch.cuda.synchronize()
    launched = loop.steps_ahead
    with SyncSites() as syncs:
        loop.step()
    assert loop.steps_ahead == launched + 1 and len(syncs.stacks) <= 1, syncs.report()
