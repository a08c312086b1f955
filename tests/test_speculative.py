"""Speculative decoding with a resident draft: exactness, the target distribution, counters, the engine."""

from __future__ import annotations

import concurrent.futures
import copy

import pytest
import torch
from conftest import make_tiny_model, noisy_copy
from helpers import VOCAB, chi_square, scrape_metrics, word_tokenizer, words
from oracle import GREEDY, engine_reference, oracle_text, reference

from kvboost_hf import ChunkReuseCache, ChunkStore, KVBoost
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.corpus import documents
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, Speculation
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming


@pytest.fixture(scope="module")
def drafts(target):
    """A different model (low acceptance), an exact copy of the target (every proposal accepted) and a copy with
    noise added to its weights (some proposals accepted)."""
    noisy = noisy_copy(target, 0.6, seed=7)
    return {"other": make_tiny_model("llama", seed=1), "copy": copy.deepcopy(target), "noisy": noisy}


def greedy(model, ids, **kwargs):
    options = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    return model.generate(ids, **{**options, **kwargs})


def sample(model, ids, **kwargs):
    """Plain sampling from the softmax (no top-k/top-p truncation)."""
    options = dict(do_sample=True, top_k=0, top_p=1.0, attention_mask=torch.ones_like(ids), pad_token_id=0)
    return model.generate(ids, **options, **kwargs)


@pytest.mark.parametrize("draft_name", ["other", "copy"])
@pytest.mark.parametrize("cache_state", ["dynamic", "reuse_cold", "reuse_warm"])
def test_drop_in_greedy_with_draft_equals_plain_greedy(target, drafts, draft_name, cache_state):
    ids = torch.randint(2, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    plain = greedy(target, ids)
    store = ChunkStore()
    if cache_state == "reuse_warm":
        greedy(target, ids, cache=ChunkReuseCache(store, target, chunking=16))
    cache = None if cache_state == "dynamic" else ChunkReuseCache(store, target, chunking=16)
    draft = drafts[draft_name]
    with Speculation(target, draft, DraftConfig(num_draft_tokens=4)) as speculation:
        out = greedy(target, ids, cache=cache, **speculation.generate_kwargs())
    assert torch.equal(out, plain)
    stats = speculation.stats
    new_tokens = out.shape[1] - ids.shape[1]
    # one draft round before each verify forward, except the last one when a single token is left to generate
    assert stats.target_forwards - 1 <= stats.draft_rounds <= stats.target_forwards
    assert stats.draft_tokens_proposed <= 4 * stats.draft_rounds
    if draft_name == "copy":  # an identical draft is always right: about g + 1 tokens per target forward
        assert stats.accepted(new_tokens) == stats.draft_tokens_proposed
        assert stats.position_acceptance(out.shape[1]) == 1.0
        assert stats.target_forwards <= -(-new_tokens // 5) + 1
    else:
        assert stats.accepted(new_tokens) < stats.draft_tokens_proposed
        assert stats.position_acceptance(out.shape[1]) < 1.0
    if cache_state == "reuse_warm":
        assert cache.last_reuse[0].cached_tokens == 64


def test_early_exit_draft_is_exact_and_schedule_is_explicit_and_restored(target):
    ids = torch.randint(2, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    plain = greedy(target, ids)
    target.generation_config.num_assistant_tokens = 20  # transformers' default, which must not be used
    with Speculation(target, settings=DraftConfig(num_draft_tokens=3, early_exit_layers=1)) as speculation:
        assert target.generation_config.num_assistant_tokens == 3
        assert target.generation_config.assistant_confidence_threshold == 0.0
        out = greedy(target, ids, **speculation.generate_kwargs())
    assert torch.equal(out, plain)
    assert target.generation_config.num_assistant_tokens == 20
    stats = speculation.stats
    assert stats.target_forwards - 1 <= stats.draft_rounds <= stats.target_forwards
    assert stats.target_forwards > 1
    assert 3 * (stats.draft_rounds - 2) < stats.draft_tokens_proposed <= 3 * stats.draft_rounds


def test_settings_are_validated(target, drafts):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        DraftConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="schedule"):
        DraftConfig(schedule="adaptive")
    with pytest.raises(ValueError, match="below the target's 2 layers"):
        Speculation(target, settings=DraftConfig(early_exit_layers=2))
    with pytest.raises(ValueError, match="not both"):
        Speculation(target, drafts["other"], DraftConfig(early_exit_layers=1))
    with Speculation(target, drafts["other"]), pytest.raises(RuntimeError, match="already drafting"):
        Speculation(target, drafts["other"]).__enter__()


def test_speculative_sampling_keeps_the_target_distribution():
    """The first sampled token with a draft follows the target's softmax, not the draft's (16-token vocabulary,
    sharpened heads so that the two distributions differ a lot: only ~40% of the draft's mass is accepted)."""
    target, draft = (make_tiny_model("llama", seed=s, vocab_size=16, num_hidden_layers=1) for s in (0, 1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
        draft.lm_head.weight.mul_(8)
        ids = torch.tensor([[3, 5, 7, 2, 9]])
        p = target(ids).logits[0, -1].softmax(-1)
        q = draft(ids).logits[0, -1].softmax(-1)
    draws, counts, accepted = 150, torch.zeros(16, dtype=torch.long), 0
    torch.manual_seed(0)
    for _ in range(draws):  # max_new_tokens=2: the draft proposes 1 token, the first token is verified
        with Speculation(target, draft, DraftConfig(num_draft_tokens=1)) as speculation:
            out = sample(target, ids, max_new_tokens=2, **speculation.generate_kwargs())
        counts[out[0, ids.shape[1]]] += 1
        accepted += speculation.stats.accepted(out.shape[1] - ids.shape[1])
    assert 0 < accepted < draws  # both the accept and the resample branch ran
    _, p_target = chi_square(counts, p)
    _, p_draft = chi_square(counts, q)
    assert p_target > 1e-3, (counts.tolist(), p.tolist())
    assert p_draft < 1e-9  # the same test rejects the draft's distribution outright


def test_seeded_sampling_with_a_draft_is_reproducible(target, drafts):
    ids = torch.randint(2, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    outputs = []
    for _ in range(2):
        torch.manual_seed(11)
        with Speculation(target, drafts["other"], DraftConfig(num_draft_tokens=3)) as speculation:
            outputs.append(sample(target, ids, max_new_tokens=16, **speculation.generate_kwargs()))
        assert speculation.stats.draft_tokens_proposed > 0
    assert torch.equal(outputs[0], outputs[1])


# ---------------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engines(target, drafts):
    tokenizer = word_tokenizer()
    plain = KVBoost(target, tokenizer, chunking=16)
    speculative = KVBoost(target, tokenizer, chunking=16, draft_model=drafts["other"], draft=DraftConfig(4))
    return plain, speculative


def test_engine_greedy_with_draft_equals_without_cold_and_warm(engines):
    plain, speculative = engines
    prompt = words(6, 60)
    undrafted = plain.generate(prompt, max_new_tokens=20, mode="baseline")
    cold = speculative.generate(prompt, max_new_tokens=20)
    warm = speculative.generate(prompt, max_new_tokens=20)
    assert cold.output_ids == warm.output_ids == engine_reference(plain, prompt, 20).tokens
    # the prompt's three whole chunks; the draft's prefill hits them too (under its own namespace)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 48)
    assert (cold.draft_cached_tokens, warm.draft_cached_tokens) == (0, 48)
    for result in (cold, warm):
        assert result.draft_tokens_proposed > 0
        assert result.draft_tokens_accepted == result.generated_tokens - result.target_forwards
        assert result.draft_acceptance_rate == result.draft_tokens_accepted / result.draft_tokens_proposed
        assert result.tokens_per_target_forward == result.generated_tokens / result.target_forwards
        assert result.draft_acceptance_rate <= result.draft_position_acceptance <= 1.0
    assert undrafted.target_forwards == undrafted.generated_tokens and undrafted.draft_acceptance_rate is None


def test_engine_streams_every_token_and_counts_totals(engines):
    _, speculative = engines
    before = speculative.cache_stats()
    streamed: list[int] = []
    result = speculative.generate(words(7, 40), max_new_tokens=16, on_token=streamed.append, mode="baseline")
    assert streamed == result.output_ids
    assert result.draft_cached_tokens is None  # reuse off: the draft runs on a plain DynamicCache
    after = speculative.cache_stats()
    assert after["generated_tokens"] - before["generated_tokens"] == result.generated_tokens
    assert after["target_forwards"] - before["target_forwards"] == result.target_forwards
    assert after["draft_tokens_proposed"] - before["draft_tokens_proposed"] == result.draft_tokens_proposed
    assert after["draft_tokens_accepted"] - before["draft_tokens_accepted"] == result.draft_tokens_accepted
    assert 0.0 <= after["draft_acceptance_rate"] <= 1.0


def test_engine_batches_decode_with_the_draft(engines, drafts):
    """Rows of one batch verify their own proposals in one forward and accept different counts; each row's greedy
    tokens are transformers' own greedy tokens for it alone."""
    plain, _ = engines
    speculative = KVBoost(plain.model, plain.tokenizer, chunking=16, draft_model=drafts["noisy"], draft=DraftConfig(4))
    prompts = [words(8, 30), words(9, 34), words(10, 21), words(11, 26)]
    batched = speculative.generate_batch(prompts, max_new_tokens=24)
    assert [r.output_ids for r in batched] == [engine_reference(plain, p, 24).tokens for p in prompts]
    assert all(r.draft_tokens_proposed > 0 for r in batched)
    assert len({(r.draft_tokens_accepted, r.generated_tokens) for r in batched}) > 1  # rows accepted differently
    assert 0 < sum(r.draft_tokens_accepted for r in batched) < sum(r.draft_tokens_proposed for r in batched)
    assert batched[0].target_forwards < max(r.generated_tokens for r in batched)  # verifies took several tokens


SAMPLING = SamplingConfig(temperature=0.9, top_k=30, presence_penalty=0.3, seed=1234)


@pytest.mark.parametrize("draft", ["other", "copy", "early_exit"])
def test_engine_seeded_sampling_is_the_same_with_a_draft_alone_and_in_a_batch(target, drafts, draft):
    """A seeded sampled row draws what transformers' ``generate()`` draws for the prompt alone under
    ``torch.manual_seed(seed)``, without a draft, with one, alone and in a batch of 4 (the draft only decides how
    many positions one target forward verifies)."""
    tokenizer = word_tokenizer()
    plain = KVBoost(target, tokenizer, chunking=16)
    if draft == "early_exit":
        speculative = KVBoost(target, tokenizer, chunking=16, draft=DraftConfig(3, early_exit_layers=1))
    else:
        speculative = KVBoost(target, tokenizer, chunking=16, draft_model=drafts[draft], draft=DraftConfig(3))
    prompt, others = words(30, 40), [words(31 + i, 25 + 7 * i) for i in range(3)]
    alone = plain.generate(prompt, max_new_tokens=16, sampling=SAMPLING)
    drafted = speculative.generate(prompt, max_new_tokens=16, sampling=SAMPLING)
    in_batch = speculative.generate_batch([*others, prompt], max_new_tokens=16, sampling=SAMPLING)[-1]
    expected = engine_reference(plain, prompt, 16, SAMPLING).tokens
    assert alone.output_ids == drafted.output_ids == in_batch.output_ids == expected
    assert drafted.draft_tokens_proposed > 0
    if draft == "copy":  # the copy's greedy proposals meet the target's draws often enough to save forwards
        assert drafted.draft_tokens_accepted > 0 and drafted.target_forwards < alone.target_forwards


def test_engine_refuses_a_draft_with_another_vocabulary(target):
    with pytest.raises(ValueError, match="vocabulary has 64 entries"):
        KVBoost(target, word_tokenizer(), draft_model=make_tiny_model("llama", vocab_size=64))
    with pytest.raises(TypeError, match="draft_model must be"):
        KVBoost(target, word_tokenizer(), draft_model=3)
    with pytest.raises(ValueError, match="below the target's"):
        KVBoost(target, word_tokenizer(), draft=DraftConfig(early_exit_layers=5))


def test_server_metrics_expose_the_draft_counters(engines):
    _, speculative = engines
    stats, samples = scrape_metrics(speculative, words(10, 30))
    for name in ("target_forwards", "draft_tokens_proposed", "draft_tokens_accepted"):
        assert samples[f"kvboost_{name}_total"] == stats[name]
    assert samples["kvboost_draft_acceptance_rate"] == pytest.approx(stats["draft_acceptance_rate"])


def test_server_flags_name_the_draft():
    import argparse

    from kvboost_hf.core.settings import settings_from_args
    from kvboost_hf.server.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--draft-model", "drafts/small", "--num-draft-tokens", "3"])
    assert (args.draft_model, settings_from_args(DraftConfig, args).num_draft_tokens) == ("drafts/small", 3)
    assert parser.parse_args([]).draft_model is None


# ---------------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("early_exit", [False, True])
def test_streamed_target_with_draft_and_chunk_reuse_equals_resident_greedy(early_exit):
    """A streamed target (3 layers, an odd number, all streamed over 2 slots) with a resident draft or an
    early-exit draft and a ChunkReuseCache, cold then warm: the resident target's greedy output, and fewer bytes
    streamed per generated token than streaming without a draft."""
    resident = make_tiny_model("llama", num_hidden_layers=3)
    streamed = make_tiny_model("llama", num_hidden_layers=3)
    handle = enable_layer_streaming(streamed, LayerStreamingConfig(num_slots=2))
    draft = copy.deepcopy(resident)
    settings = DraftConfig(num_draft_tokens=4, early_exit_layers=2 if early_exit else None)
    ids = torch.randint(2, VOCAB, (1, 50), generator=torch.Generator().manual_seed(12))
    expected = greedy(resident, ids)
    new_tokens = expected.shape[1] - ids.shape[1]

    def streamed_greedy(**kwargs) -> tuple[torch.Tensor, int]:
        """Greedy output of the streamed target and the bytes streamed meanwhile."""
        before = handle.stats().bytes_streamed
        out = greedy(streamed, ids, **kwargs)
        return out, handle.stats().bytes_streamed - before

    _, plain_bytes = streamed_greedy()
    store = ChunkStore()
    for state in ("cold", "warm"):
        cache = ChunkReuseCache(store, streamed, chunking=16)
        with Speculation(streamed, None if early_exit else draft, settings) as speculation:
            out, spent = streamed_greedy(cache=cache, **speculation.generate_kwargs())
        assert torch.equal(out, expected), state
        assert cache.last_reuse[0].cached_tokens == (48 if state == "warm" else 0)
        if not early_exit:  # an identical draft: about 5 tokens per target forward
            assert spent / new_tokens <= 0.45 * plain_bytes / new_tokens
        assert speculation.stats.target_forwards < new_tokens
    handle.close()


def test_engine_reports_streamed_bytes_per_token_with_a_draft(target):
    streamed = copy.deepcopy(target)
    handle = enable_layer_streaming(streamed, LayerStreamingConfig())
    plain_engine = KVBoost(streamed, word_tokenizer(), chunking=16)
    engine = KVBoost(streamed, word_tokenizer(), chunking=16, draft_model=copy.deepcopy(target), draft=DraftConfig(4))
    prompt = words(13, 40)
    plain = plain_engine.generate(prompt, max_new_tokens=12)
    drafted = engine.generate(prompt, max_new_tokens=12)
    assert drafted.output_ids == plain.output_ids
    assert drafted.streamed_bytes_per_token <= 0.45 * plain.streamed_bytes_per_token
    assert engine.cache_stats()["streaming_bytes_streamed"] == handle.stats().bytes_streamed
    handle.close()
    prompts = engine.prompts
    resident = reference(target, engine.encode(prompt), 12, GREEDY, prompts.eos_token_ids, prompts.pad_token_id)
    assert drafted.output_ids == resident.tokens  # transformers' greedy generate() on the resident target


# ---------------------------------------------------------------------------------------------------- embedded model
@pytest.mark.slow
def test_embedded_model_with_early_exit_and_engine_drafts_equals_greedy(embedded_engine):
    """SmolLM2 chat prompt (it holds special tokens): an early-exit draft (20 of 30 layers) and the engine itself
    as a draft (same weights: its prefill hits the target's chunks) leave the greedy output unchanged."""
    system = {"role": "system", "content": documents()[1][1][:500]}
    messages = [system, {"role": "user", "content": "Summarise this in one sentence."}]
    expected = engine_reference(embedded_engine, messages, 16)
    shared = {"chunking": 64, "store": embedded_engine.store}
    model, tokenizer = embedded_engine.model, embedded_engine.tokenizer
    early = KVBoost(model, tokenizer, **shared, draft=DraftConfig(3, early_exit_layers=20)).generate(messages, 8)
    itself = KVBoost(model, tokenizer, draft_model=embedded_engine, **shared, draft=DraftConfig(3))
    itself.generate(messages, max_new_tokens=16)
    again = itself.generate(messages, max_new_tokens=16)
    assert early.output_ids == expected.tokens[:8] and again.output_ids == expected.tokens
    assert early.draft_tokens_proposed > 0 and early.draft_acceptance_rate < 1.0
    assert again.draft_acceptance_rate == 1.0 and again.target_forwards <= -(-16 // 4) + 1
    assert again.draft_cached_tokens == again.cached_tokens > 0


def test_server_seeded_request_gets_the_same_tokens_alone_batched_and_with_a_draft(engines):
    """Over loopback with the openai client: a seeded sampled request returns transformers' seeded ``generate()``
    text from a server without a draft, and from a server with one both alone and inside a batch of 4 (greedy
    neighbours equal transformers' greedy text too); the draft counters in /metrics grow in both cases."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from helpers import API_KEY, LiveServer, metric, metric_above

    from kvboost_hf.server.app import ServerConfig, create_app

    plain, speculative = engines
    seeded = {"prompt": words(40, 30), "max_tokens": 12, "temperature": 0.9, "presence_penalty": 0.3, "seed": 77}
    others = [words(41 + i, 24 + 5 * i) for i in range(3)]
    expected = [oracle_text(plain, p, 12) for p in others]
    drawn = oracle_text(plain, seeded["prompt"], 12, SamplingConfig(temperature=0.9, presence_penalty=0.3, seed=77))
    settings = ServerConfig(model_name="tiny", api_key=API_KEY, batch_window_ms=300, max_batch_size=4)

    def complete(client, **body):
        return client.completions.create(model="tiny", **body).choices[0].text

    with LiveServer(create_app(plain, settings)) as server:
        reference = complete(server.client(), **seeded)
    assert reference == drawn
    with LiveServer(create_app(speculative, settings)) as server:
        client = server.client()
        before = metric(server, "kvboost_draft_tokens_proposed_total")
        assert complete(client, **seeded) == reference
        proposed = metric_above(server, "kvboost_draft_tokens_proposed_total", before)
        assert proposed > before
        batches = metric(server, "kvboost_batch_size_count")
        bodies = [seeded] + [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in others]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one batch window: decoded together
            texts = list(pool.map(lambda body: complete(client, **body), bodies))
        assert texts == [reference, *expected]
        assert metric_above(server, "kvboost_draft_tokens_proposed_total", proposed) > proposed
        assert metric(server, "kvboost_batch_size_count") == batches + 1  # one batch (later arrivals join it)


@pytest.mark.parametrize("draft", ["early_exit", "noisy"])
def test_a_prompt_joining_rows_on_their_last_token_keeps_the_draft_aligned(draft):
    """Rows with one token left take a plain step (nothing to draft); the draft is fed it too, so a prompt joined
    next pads target and draft alike (the draft was a column short: the next round's draft forward raised)."""
    model = make_tiny_model("llama", seed=0)
    options = (
        {"draft": DraftConfig(3, early_exit_layers=1)}
        if draft == "early_exit"
        else {"draft_model": noisy_copy(model, 0.3, 1), "draft": DraftConfig(3)}
    )
    engine = KVBoost(model, word_tokenizer(), chunking=8, **options)
    prompts = [words(3, 3), words(118, 18), words(219, 19)]
    together = engine.generate_many(prompts, 8, mode="baseline", max_batch_size=2)
    alone = [engine.generate(prompt, 8, mode="baseline") for prompt in prompts]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]


def test_speculation_on_a_sliding_window_model_is_refused_by_name():
    """Tree masks cover every cached column and a sliding layer sees its window only: past the window the verify
    forward raised a size mismatch. Refused at construction and on assignment, target or draft."""
    sliding = make_tiny_model("mistral", sliding_window=24)
    with pytest.raises(ConfigError, match="does not support sliding-window attention"):
        KVBoost(sliding, word_tokenizer(), chunking=8, draft=DraftConfig(3, early_exit_layers=1))
    with pytest.raises(ConfigError, match=r"sliding-window attention \(MistralForCausalLM\)"):
        KVBoost(make_tiny_model("llama"), word_tokenizer(), chunking=8, draft_model=sliding, draft=DraftConfig(3))
    engine = KVBoost(sliding, word_tokenizer(), chunking=8)
    with pytest.raises(ConfigError, match="does not support sliding-window attention"):
        engine.draft_settings = DraftConfig(3, early_exit_layers=1)


def test_assigned_draft_settings_are_checked_and_take_effect():
    """The setter checks as the constructor does (it stored anything: a dict, 99 exit layers of 2) and turns
    early-exit speculation on (it was silently ignored)."""
    model = make_tiny_model("llama", seed=3)
    engine = KVBoost(model, word_tokenizer(), chunking=8)
    for bad, message in ((DraftConfig(3, early_exit_layers=99), "below the target's 2 layers"), ({}, "DraftConfig")):
        with pytest.raises(ConfigError, match=message):
            engine.draft_settings = bad
    plain = engine.generate(words(5, 10), 6)
    engine.draft_settings = DraftConfig(3, early_exit_layers=1)
    drafted = engine.generate(words(5, 10), 6)
    assert drafted.output_ids == plain.output_ids and drafted.draft_forwards > 0
