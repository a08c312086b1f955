"""The engine facade on the real embedded model (SmolLM2-135M-Instruct, fp32, CPU)."""

from __future__ import annotations

import uuid

import pytest
import torch
from conftest import LENGTH_DEPENDENT, make_tiny_model
from helpers import word_tokenizer, words
from oracle import engine_reference, expected_text
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, GPT2Config, GPT2LMHeadModel

from kvboost_hf import ChunkReuseCache, ChunkStore, KVBoost, SamplingConfig, StoreConfig, UnsupportedModelError
from kvboost_hf.core.errors import ConfigError, InputError, MissingFileError
from kvboost_hf.corpus import documents
from kvboost_hf.hf import rows as rows_module
from kvboost_hf.hf.models import check_model_support, embedded_model_dir

SYSTEM = {"role": "system", "content": documents()[0][1][:600]}


def test_greedy_output_and_first_logits_match_plain_generate(embedded_engine):
    prompts = [f"{text[:500]}\n\nQuestion: what is the {title} module for?\nAnswer:" for title, text in documents()[:2]]
    report = embedded_engine.verify_correctness(prompts, max_new_tokens=8)  # ~150-token prompts: 2 chunks and a tail
    assert report, report.checks
    assert report.max_logit_diff < 1e-4
    assert all(check.cached_tokens >= 64 for check in report.checks)


def test_verify_correctness_catches_a_loop_defect_every_mode_shares(embedded_engine, monkeypatch):
    """The oracle is transformers' ``generate()``, not the decode loop in baseline mode: a token choice broken for
    every mode (the runner-up instead of the argmax, for a row alone and for plain greedy rows chosen together) is
    reported at the first step."""

    def runner_up(scores, params, generators):
        return scores.topk(2).indices[:, 1].tolist()

    monkeypatch.setattr(rows_module, "choose_tokens", runner_up)  # rows choosing with their processors (sample)
    monkeypatch.setattr(rows_module, "greedy_tokens", lambda scores: scores.topk(2, dim=-1).indices[..., 1])  # sample
    report = embedded_engine.verify_correctness(["The capital of France is"], max_new_tokens=3)
    assert not report and report.checks[0].first_differing_step == 0


def test_multi_turn_chat_reuses_previous_turns(embedded_engine):
    messages = [SYSTEM, {"role": "user", "content": "What does this module do?"}]
    previous_tokens = 0
    for turn in range(2):
        reused = embedded_engine.generate(messages, max_new_tokens=12)
        assert reused.output_ids == engine_reference(embedded_engine, messages, 12).tokens
        if turn:
            assert reused.cached_tokens >= previous_tokens - 64
            assert reused.kv_reuse_ratio > 0.5
        previous_tokens = reused.prompt_tokens + reused.generated_tokens
        messages += [
            {"role": "assistant", "content": reused.output_text},
            {"role": "user", "content": f"Tell me more, part {turn}."},
        ]


def test_warm_reports_alignment(embedded_engine):
    text = documents()[2][1][:900]
    salt = uuid.uuid4().hex  # a namespace of its own: what earlier tests stored does not count
    result = embedded_engine.warm(text, cache_salt=salt)
    ids = embedded_engine.encode(text)
    assert result.token_count == len(ids)
    assert result.chunks_stored >= len(ids) // 64  # every full chunk (by prefix and content key)
    assert result.partial_tail_tokens == len(ids) % 64
    assert result.chunk_boundary_aligned == (len(ids) % 64 == 0)
    assert (result.alignment_warning is None) == result.chunk_boundary_aligned
    follow = embedded_engine.generate(text + " In short,", max_new_tokens=4, cache_salt=salt)
    assert follow.cached_tokens == (len(ids) // 64) * 64


def test_warm_stores_the_unfinished_last_chunk_of_token_ids_and_says_so(embedded_engine):
    """Token ids are stored with their partial last chunk (the report said it was not stored, and it was hit)."""
    salt = uuid.uuid4().hex
    ids = embedded_engine.encode(documents()[1][1])[:70]
    result = embedded_engine.warm(ids, cache_salt=salt)
    assert result.chunks_stored == 2 and result.partial_tail_tokens == 6
    assert "stored as an unfinished chunk" in result.alignment_warning
    follow = embedded_engine.generate([*ids, *embedded_engine.encode(" In short,")[1:]], 2, cache_salt=salt)
    assert follow.cached_tokens == 70


def test_a_warmed_string_hits_at_an_offset_with_a_tokenizer_that_adds_a_bos():
    """warm(str) tokenizes with the BOS; the same text as a later segment has none. Its content chunks are also
    stored as tokenized without it, so a prompt holding it after a header loads all of it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from kvboost_hf import RepairConfig

    vocab = {"<pad>": 0, "<eos>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<pad>", eos_token="<eos>", pad_token="<pad>", bos_token="<s>"
    )
    doc, header = " ".join(f"w{3 + i * 7 % 120}" for i in range(40)) + " ", "w5 w6 w7 w8 w9 "
    engine = KVBoost(make_tiny_model("llama"), tokenizer, chunking=8, repair=RepairConfig("none"))
    warmed = engine.warm(doc)
    assert warmed.token_count == 41 and warmed.chunks_stored > 6  # with the BOS, and again without it
    assert engine.generate([header, doc, "w10 w11"], max_new_tokens=1).cached_tokens == 40
    assert engine.generate(doc + "w10 w11", max_new_tokens=1).cached_tokens == 40  # exact prefix hits still


def test_batch_equals_each_prompt_alone(embedded_engine):
    shared = documents()[3][1][:700]
    prompts = [shared + "\nQ: name one class.\nA:", shared + "\nQ: what is this module for? Be brief.\nA:"]
    alone = [engine_reference(embedded_engine, p, 6).tokens for p in prompts]
    batched = embedded_engine.generate_batch(prompts, max_new_tokens=6)
    assert [r.output_ids for r in batched] == alone
    many = embedded_engine.generate_many([prompts[1], "Hello there", prompts[0]], max_new_tokens=6)
    assert [many[0].output_ids, many[2].output_ids] == [alone[1], alone[0]]
    assert many[1].prompt.startswith("Hello there")


def test_temperature_zero_is_greedy_and_stop_strings_cut_exactly(embedded_engine):
    prompt = "List the numbers: 1, 2, 3,"
    expected = engine_reference(embedded_engine, prompt, 12)  # transformers' greedy answer, computed once
    greedy = embedded_engine.generate(prompt, max_new_tokens=12, temperature=0.0, do_sample=True)
    assert greedy.output_ids == expected.tokens
    stop_at = expected_text(embedded_engine.tokenizer, expected)[3:6]  # three characters of its text
    stopped = embedded_engine.generate(prompt, max_new_tokens=12, stop=[stop_at])
    assert stopped.finish_reason == "stop"
    assert stopped.output_text == expected_text(embedded_engine.tokenizer, expected, stop=[stop_at])


def test_sampling_is_seeded_alone_and_in_a_batch(embedded_engine):
    """Seeded rows draw what transformers' ``generate()`` draws for the prompt alone under ``torch.manual_seed``
    with the same processors (see tests/oracle.py), alone and in a batch."""
    a = embedded_engine.generate("Once upon a time", max_new_tokens=8, do_sample=True, temperature=0.9, seed=3)
    sampled = SamplingConfig(temperature=0.9, seed=3)
    assert a.output_ids == engine_reference(embedded_engine, "Once upon a time", 8, sampled).tokens
    batch = embedded_engine.generate_batch(
        ["In a faraway land", "Once upon a time"], max_new_tokens=8, do_sample=True, temperature=0.9, seed=3
    )
    assert batch[1].output_ids == a.output_ids  # every row is sampled with the seed as if alone
    full = SamplingConfig(temperature=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=3)
    c = embedded_engine.generate("Once upon a time", max_new_tokens=8, sampling=full)
    assert c.output_ids == engine_reference(embedded_engine, "Once upon a time", 8, full).tokens


def test_on_token_gets_every_row_token_as_it_exists(embedded_engine):
    seen: list[tuple[int, int]] = []
    results = embedded_engine.generate_batch(
        ["The sky is", "Two plus two is"], max_new_tokens=5, on_token=lambda row, token: seen.append((row, token))
    )
    assert [[t for r, t in seen if r == row] for row in (0, 1)] == [r.output_ids for r in results]


def test_result_fields_and_stats(embedded_engine):
    result = embedded_engine.generate("The capital of France is", max_new_tokens=5, logprobs=2)
    assert result.generated_tokens == len(result.output_ids) <= 5
    assert 0 < result.ttft_ms <= result.total_ms
    assert len(result.token_logprobs) == result.generated_tokens
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in result.top_logprobs)
    stats = embedded_engine.cache_stats()
    assert {"hits", "misses", "chunks", "evictions", "ram_bytes"} <= stats.keys()


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ("", {}, "empty"),
        ([], {}, "non-empty list"),
        ("word " * 9000, {}, "exceeds the model's context"),
        ("hello", {"max_new_tokens": 0}, "max_new_tokens"),
        (None, {}, "got NoneType"),
        (42, {}, "got int"),
        ("hello", {"stop": ""}, "stop must be a non-empty string"),
        ("hello", {"stop": ["ok", None]}, "stop must be a non-empty string"),
        ("hello", {"logprobs": -1}, "logprobs must be"),
        ("hello", {"logprobs": True}, "logprobs must be"),
        ("hello", {"stop": 5}, "stop must be"),
        ("hello", {"temperature": "hot", "do_sample": True}, "temperature='hot'"),
        ("hello", {"seed": 2**70}, "seed="),
        ("hello", {"sampling": {"temperature": 0}}, "sampling must be a SamplingConfig"),
        ("hello", {"cancel": True}, "cancel must be a threading.Event"),
        ("hello", {"repair": "selective"}, "repair must be a RepairConfig"),
        ("hello", {"mode": "fast"}, "mode must be one of"),
        ("hello", {"sampling": SamplingConfig(logit_bias={10**6: 1.0})}, "logit_bias token ids"),
        ("hello", {"sampling": SamplingConfig(stop_token_ids=(10**6,))}, "stop_token_ids"),
        (b"Hello", {}, "got bytes"),
        ([{"role": "user", "content": None}], {}, "message 0: role must be a string and content"),
        ([{"role": 3, "content": "hi"}], {}, "message 0: role must be a string"),
        ("hello", {"cache_salt": ["a"]}, "cache_salt must be a string"),
        ("hello", {"on_token": 3}, "on_token must be a function"),
    ],
)
def test_bad_input_is_refused_and_store_unchanged(embedded_engine, prompt, kwargs, message):
    def store_and_decode_stats() -> dict:  # the token ids cache may keep a refused prompt's pieces: not the store
        return {k: v for k, v in embedded_engine.cache_stats().items() if not k.startswith("token_cache_")}

    before = store_and_decode_stats()
    with pytest.raises(ValueError, match=message):
        embedded_engine.generate(prompt, **kwargs)
    assert store_and_decode_stats() == before


def test_token_id_prompts_are_checked_against_the_vocabulary(embedded_engine):
    vocabulary = embedded_engine.model.config.vocab_size
    assert embedded_engine.encode([5, 6, vocabulary - 1]) == [5, 6, vocabulary - 1]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        embedded_engine.encode([5, vocabulary])


def test_generate_many_of_no_prompts_is_empty_and_generate_batch_refuses_them(embedded_engine):
    assert embedded_engine.generate_many([]) == []
    with pytest.raises(ValueError, match="prompts is empty"):
        embedded_engine.generate_batch([])
    for call in (embedded_engine.generate_batch, embedded_engine.generate_many):  # not one prompt per character
        with pytest.raises(ValueError, match="prompts must be a list of prompts, got str"):
            call("Hello", 2)
    with pytest.raises(ValueError, match="got NoneType"):
        embedded_engine.generate_many(None)


def test_more_logprobs_than_the_vocabulary_are_all_of_it(embedded_engine):
    vocabulary = embedded_engine.model.config.vocab_size
    result = embedded_engine.generate("Hello", max_new_tokens=1, logprobs=vocabulary + 5)
    assert len(result.top_logprobs[0]) == vocabulary


def test_bad_settings_are_refused(embedded_engine):
    with pytest.raises(ValueError, match="chunk_size"):
        KVBoost(embedded_engine.model, embedded_engine.tokenizer, chunking=0)
    with pytest.raises(ValueError, match="kv_cache_bits"):
        KVBoost(embedded_engine.model, embedded_engine.tokenizer, store=StoreConfig(kv_cache_bits=3))


@pytest.mark.parametrize("starts", [[2.5], ["a", 3], [-4, 16], 5])
def test_bad_segment_starts_of_a_new_cache_are_named(embedded_engine, starts):
    with pytest.raises(InputError, match="segment_starts"):
        embedded_engine.new_cache(segment_starts=starts)


def test_unsupported_architectures_are_named():
    with pytest.raises(UnsupportedModelError, match="gpt2 uses learned absolute position"):
        check_model_support(GPT2Config())
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        KVBoost(model, None)


def test_latent_attention_models_are_refused_by_name():
    """DeepSeek-V3 caches a compressed latent, not per-head K/V: every stored chunk would miss, so it is refused."""
    config = DeepseekV3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=32)
    with pytest.raises(UnsupportedModelError, match="deepseek_v3 uses multi-head latent attention"):
        check_model_support(config)
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        check_model_support(config, strict=False)


def test_unknown_architecture_is_a_warning_when_not_strict(caplog):
    config = make_tiny_model("llama").config
    config.model_type = "mystery"
    with pytest.raises(UnsupportedModelError, match="strict=False"):
        check_model_support(config)
    check_model_support(config, strict=False)
    assert "not a tested architecture" in caplog.text


def test_loads_a_local_model_directory(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = KVBoost.from_pretrained(tmp_path, chunking=8, device="cpu")
    assert engine.model.config.model_type == "qwen2"
    ids = torch.tensor([engine.encode("a b c d e f g h i j k l m n o p")])
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :].tolist()
    for _ in range(2):
        assert engine.generate("a b c d e f g h i j k l m n o p", max_new_tokens=5).output_ids[:5] == expected


def test_bad_load_arguments_are_named_before_any_weight_loads(tmp_path, monkeypatch):
    """A missing folder was reported as a bad hub repo id, a GGUF file as a bad config, ``dtype="bogus"`` as an
    AttributeError of torch, CUDA without one as an AssertionError; a folder without a tokenizer failed only after
    its weights loaded."""
    (gguf := tmp_path / "model.gguf").write_bytes(b"GGUF")
    no_tokenizer = tmp_path / "weights-only"
    make_tiny_model("llama").save_pretrained(no_tokenizer)
    loaded: list = []
    for kwargs, error, named in (
        ({"model_name_or_path": tmp_path / "missing"}, MissingFileError, "does not exist"),
        ({"model_name_or_path": "./typo-model"}, MissingFileError, "typo-model does not exist"),
        ({"model_name_or_path": gguf}, InputError, "gguf_file="),
        ({"dtype": "bogus"}, ConfigError, "dtype must be a floating torch dtype"),
        ({"dtype": "int8"}, ConfigError, "dtype must be a floating torch dtype"),
        ({"device": "gpu"}, ConfigError, "device must be a torch device"),
    ):
        with pytest.raises(error, match=named):
            KVBoost.from_pretrained(**kwargs)
    original = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(1) or original(*a, **k))
    with pytest.raises((OSError, ValueError)):  # transformers' own error about the tokenizer files
        KVBoost.from_pretrained(no_tokenizer, device="cpu")
    assert not loaded
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="asks for CUDA"):
            KVBoost.from_pretrained(device="cuda")


def test_warmed_documents_hit_in_any_order_as_segments(embedded_engine):
    from kvboost_hf.core.config import RepairConfig

    docs = [f"Document: {title}\n{text[:500]}\n\n" for title, text in documents()[5:7]]
    for doc in docs:
        warm = embedded_engine.warm(doc)
        assert warm.chunks_stored >= 1
    prompt = [docs[1], docs[0], "Question: which module is described first?\nAnswer:"]
    plain = engine_reference(embedded_engine, prompt, 6)
    approx = embedded_engine.generate(prompt, max_new_tokens=6, repair=RepairConfig("cacheblend", 0.15))
    assert approx.approx_tokens > 0 and approx.recomputed_tokens > 0
    exact = embedded_engine.generate(prompt, max_new_tokens=6, repair=RepairConfig("cacheblend", 1.0))
    assert exact.output_ids == plain.tokens and exact.approx_tokens == 0
    assert approx.cached_tokens > exact.cached_tokens
    # ratio 1.0 made the whole prompt exact, so it was written back by prefix key: now a plain exact hit
    again = embedded_engine.generate(prompt, max_new_tokens=6, repair=RepairConfig("none"))
    assert again.output_ids == plain.tokens and again.recomputed_tokens == 0


def test_constructor_arguments_of_the_wrong_kind_are_refused_by_name():
    """A path for the model, no tokenizer, a string store or repair, a None store or swapped arguments raised
    AttributeError from inside the constructors."""
    model = make_tiny_model("llama")
    tokenizer = word_tokenizer()
    for call, named in (
        (lambda: KVBoost("path/to/model", tokenizer), "model must be a loaded transformers model"),
        (lambda: KVBoost(model, None), "tokenizer must be a transformers tokenizer"),
        (lambda: KVBoost(model, tokenizer, store="ram"), "store must be a ChunkStore, a StoreConfig or None"),
        (lambda: ChunkReuseCache(None, model), "store must be a ChunkStore"),
        (lambda: ChunkReuseCache(model, ChunkStore()), "model must be a transformers model"),
        (lambda: ChunkReuseCache(ChunkStore(), model, repair="cacheblend"), "repair must be a RepairConfig"),
    ):
        with pytest.raises(ConfigError, match=named):
            call()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_budget": 8.5}, "token_budget must be a whole number"),
        ({"token_budget": None}, "token_budget must be a whole number"),
        ({"max_batch_size": "4"}, r"max_rows \(max_batch_size\) must be a whole number"),
        ({"kv_budget_bytes": "1e9"}, "kv_budget_bytes must be"),
        ({"on_token": 3}, "on_token must be a function"),
    ],
)
def test_bad_batching_arguments_are_refused_before_any_forward(kwargs, message):
    """They raised TypeError from inside the scheduler, one (a fractional token budget) after a forward ran."""
    engine = KVBoost(make_tiny_model("llama"), word_tokenizer(), chunking=8)
    with pytest.raises(ConfigError, match=message):
        engine.generate_many(["w1 w2 w3", "w4 w5"], max_new_tokens=2, **kwargs)
    assert engine.cache_stats()["target_forwards"] == 0


def test_a_results_prompt_is_its_text_as_given_and_token_ids_decoded():
    """A text prompt comes back as given (decoding it again cost ~15 ms per call at 32k tokens); token ids and chat
    messages, which have no text of their own, are decoded."""
    engine = KVBoost(make_tiny_model("llama", seed=0), word_tokenizer(), chunking=8)
    text = "the cat sat on the mat"
    assert engine.generate(text, max_new_tokens=2).prompt == text
    ids = engine.encode(text)
    assert engine.generate(ids, max_new_tokens=2).prompt == engine.tokenizer.decode(ids)


LONG_ROPE = LENGTH_DEPENDENT["longrope"][1]  # a tiny Phi3 whose long factors start past 64 tokens


def test_a_long_rope_row_passing_its_original_length_is_recomputed_as_generate_does(caplog):
    """Phi3's ``generate()`` drops its cache once the sequence passes ``original_max_position_embeddings`` and
    recomputes it with the long RoPE factors; the engine's rows kept their short-factor K/V and took other tokens
    (a 50-token prompt: from token 18 on). Now such a row is prefilled again from its whole context, once: its
    tokens equal ``generate()``'s, beside a row that never passes the length and one whose prompt starts past it."""
    import logging

    from kvboost_hf.hf.models import cache_restart_length

    model = make_tiny_model("phi3", **LONG_ROPE)
    engine = KVBoost(model, word_tokenizer(), chunking=8)
    assert cache_restart_length(model) == 64 and cache_restart_length(make_tiny_model("llama")) is None
    prompts = [words(5, 50), words(6, 20), words(7, 80)]  # passes 64 while decoding; never does; starts past it
    assert [len(engine.encode(p)) for p in prompts] == [50, 20, 80]
    expected = [engine_reference(engine, p, 30).tokens for p in prompts]
    with caplog.at_level(logging.INFO, logger="kvboost_hf.scheduling"):
        assert engine.generate(prompts[0], max_new_tokens=30).output_ids == expected[0]
    assert "prefilling 1 request(s) again past 64 tokens" in caplog.text
    results = engine.generate_many(prompts, max_new_tokens=30, max_batch_size=4)
    assert [result.output_ids for result in results] == expected


def test_a_long_rope_row_never_shares_a_forward_with_rows_on_the_other_side_of_its_original_length():
    """transformers picks Phi3's RoPE factors from the largest position of a whole forward: a row decoding below
    ``original_max_position_embeddings`` beside one past it took the long factors from then on (fp32 log-probs off
    by up to 0.0016 on this tiny model from token 21; tokens equal only by luck), and a warm prompt's graphed forward
    padded past the length switched its own queries (0.0023 from the first token). Now such rows run in batches of
    their side (scheduler rule 2e) and such a prefill runs eagerly: every log-prob equals the row's alone (to fp32
    rounding)."""
    from kvboost_hf.hf.graphs import GraphConfig

    model = make_tiny_model("phi3", **LONG_ROPE)
    engine = KVBoost(model, word_tokenizer(), chunking=8)
    prompts = [words(5, 40), words(6, 46)]  # the first stays below 64 tokens; the second passes it at its 19th
    alone = [engine.generate(p, max_new_tokens=24, logprobs=0).token_logprobs for p in prompts]
    engine.store.clear()
    together = engine.generate_many(prompts, max_new_tokens=24, max_batch_size=4, logprobs=0)
    assert max_difference([result.token_logprobs for result in together], alone) < 1e-5  # fp32 rounding only

    graphed = KVBoost(model, word_tokenizer(), chunking=8, graphs=GraphConfig(enabled=True))
    follow_up = f"{prompts[0]} {words(9, 18)}"  # 40 reused tokens, 18 new ones: a 32-query bucket reaches 72
    for each in (engine, graphed):
        each.generate(prompts[0], max_new_tokens=2)
    expected = engine.generate(follow_up, max_new_tokens=6, logprobs=0)
    result = graphed.generate(follow_up, max_new_tokens=6, logprobs=0)
    assert result.cached_tokens == expected.cached_tokens == 40 and graphed.graphs.graphed_prefills == 0
    assert max_difference([result.token_logprobs], [expected.token_logprobs]) < 1e-5


def test_a_long_rope_row_drafts_no_tree_past_its_original_length():
    """A speculative round's tree reaches positions past the row's last token; one reaching past
    ``original_max_position_embeddings`` switched every query of that verify forward to the long factors, those of
    the tokens below the length included (fp32 log-probs off by up to 0.0019 from a plain run). Now a row at or
    below the length drafts no deeper than it: the same log-probs as without a draft, and drafts still proposed."""
    from kvboost_hf import DraftConfig

    model = make_tiny_model("phi3", **LONG_ROPE)
    plain = KVBoost(model, word_tokenizer(), chunking=8)
    drafted = KVBoost(model, word_tokenizer(), chunking=8, draft_model=plain, draft=DraftConfig(4))
    for length in (58, 61):  # 14 new tokens pass 64 a few tokens in
        prompt = words(5, length)
        expected = plain.generate(prompt, max_new_tokens=14, logprobs=0)
        result = drafted.generate(prompt, max_new_tokens=14, logprobs=0)
        assert result.output_ids == expected.output_ids and result.draft_tokens_proposed > 0
        assert max_difference([result.token_logprobs], [expected.token_logprobs]) < 1e-5


def max_difference(got: list[list[float]], expected: list[list[float]]) -> float:
    """The largest difference between two rows' lists of log-probabilities (equal lengths asserted)."""
    assert [len(row) for row in got] == [len(row) for row in expected]
    return max(abs(a - b) for row, other in zip(got, expected, strict=True) for a, b in zip(row, other, strict=True))
