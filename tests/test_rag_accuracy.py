"""The rag_accuracy workload (planted facts, shuffled prompts, exact-match scoring) and the chunk-heads repair."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from kvboost_hf import ChunkReuseCache, ChunkStore, RepairConfig
from kvboost_hf.bench.rag_accuracy import (
    DEFAULT_REPAIR,
    FULL,
    HEADER,
    NOISE,
    StoreSnapshot,
    build_questions,
    configurations,
    extract_answer,
    methods,
    paired_against,
    paired_comparison,
    paired_table,
    plot,
    report,
    select_configurations,
)
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.corpus import fact_documents
from kvboost_hf.store.config import StoreConfig


def test_fact_documents_plant_every_fact_once_with_distinct_answers():
    docs = fact_documents(6, facts_per_doc=3, seed=1)
    facts = [fact for _, doc_facts in docs for fact in doc_facts]
    assert len(facts) == 18
    assert len({f.place for f in facts}) == 18 and len({f.answer for f in facts}) == 18
    for text, doc_facts in docs:
        for fact in doc_facts:
            assert len(fact.answer) == 4 and fact.answer.isdigit()
            assert sum(fact.sentence in other for other, _ in docs) == 1 and fact.sentence in text
    assert fact_documents(6, facts_per_doc=3, seed=1) == docs
    with pytest.raises(ValueError, match="at most"):
        fact_documents(50)


def test_fixed_sources_give_the_same_documents_at_every_length():
    short, long = (fact_documents(8, 1, chars, seed=2, source_chars=3200) for chars in (800, 3200))
    for (short_text, short_facts), (long_text, long_facts) in zip(short, long, strict=True):
        assert short_text.split("\n")[0] == long_text.split("\n")[0] and short_facts == long_facts
        assert len(short_text) < 1000 < 3200 <= len(long_text)
    assert [t.split("\n")[0] for t, _ in fact_documents(8, 1, 800, seed=2)] != [
        t.split("\n")[0] for t, _ in short
    ]  # without fixed sources, short documents come from other texts


def test_questions_hold_their_answer_in_exactly_one_shuffled_document():
    documents, questions = build_questions(5, 3, 12, seed=0)
    orders = set()
    for question in questions:
        header, *docs, asked = question.segments
        assert header == HEADER and len(docs) == 3 and set(docs) <= set(documents)
        place = asked.rsplit("The access code of the ", 1)[1].removesuffix(" is")
        assert asked.count(f" {place}") == 3  # the question, and twice in the started answer
        sentence = f"The access code of the {place} is {question.answer}."
        assert sum(sentence in doc for doc in docs) == 1
        orders.add(tuple(documents.index(d) for d in docs))
    assert len(orders) > 1
    with pytest.raises(ValueError, match="docs_per_query"):
        build_questions(3, 4, 1)


def test_extract_answer_takes_the_first_number_only():
    assert extract_answer(" 4821.\nThe") == "4821"
    assert extract_answer(" code 12 then 4821") == "12"
    assert extract_answer(" none") == ""


def test_configurations_cover_full_prefill_none_every_method_and_realignment():
    names = tuple(methods(head_tokens=2, filter_layers=3))
    configs = configurations((0.15, 1.0), names, realign_tokens=(8,), head_tokens=2, filter_layers=3)
    assert configs[FULL] is None
    assert configs["none"].strategy.value == "none"
    assert configs["cacheblend@0.15"].ratio == 0.15 and configs["selective@1"].ratio == 1.0
    assert configs["cacheblend-V@0.15"].deviation == "value"
    assert configs["cacheblend-gradual3@0.15"].filter_layers == 3
    assert configs["cacheblend+heads2@0.15"].head_tokens == 2
    both = configs["cacheblend-gradual3+heads2@0.15"]
    assert (both.filter_layers, both.head_tokens, both.deviation) == (3, 2, "key")
    assert configs["realign8"] == RepairConfig("selective", 0.0, overlap_k=0, head_tokens=8)
    assert len(configs) == 2 + 2 * len(names) + 1
    with pytest.raises(ValueError, match=r"unknown methods \['bogus'\]"):
        configurations((0.15,), ("bogus",))


def test_store_snapshot_restore_drops_only_later_keys():
    store = ChunkStore(StoreConfig(1 << 20))
    entry = ChunkKV(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    store.put("warmed", entry)
    snapshot = StoreSnapshot(store)
    store.put("written-back", entry)
    snapshot.restore()
    assert store.contains("warmed") and not store.contains("written-back")


def test_head_tokens_recompute_every_reused_chunk_head():
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 128, (32,), generator=gen) for _ in range(2)]
    for doc in docs:
        cache = ChunkReuseCache(store, model, 16, segment_starts=[0, len(doc)])
        model(doc[None], cache=cache, use_cache=True, logits_to_keep=1)
        cache.save()
    ids = torch.cat([docs[1], docs[0], torch.tensor([5, 6, 7])])[None]
    repair = RepairConfig("cacheblend", 0.05, check_layer=0, head_tokens=3)  # 2 layers: filter after layer 0
    cache = ChunkReuseCache(store, model, 16, repair, segment_starts=[0, 32, 64], write_back=False)
    model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    reuse = cache.last_reuse[0]
    # doc 1 at position 0 is an exact prefix hit; doc 0's two chunks are content hits whose 3-token heads are
    # recomputed although 5% of 32 tokens would be 2
    assert reuse.recomputed_tokens == 6 and reuse.approx_tokens == 26


def test_select_configurations_keeps_full_prefill_and_compares_ratios_as_numbers():
    configs = configurations((0.15, 0.3, 1.0))
    chosen = select_configurations(configs, ["cacheblend@1.0", "none", "selective@0.150"])
    assert list(chosen) == [FULL, "none", "selective@0.15", "cacheblend@1"]
    assert chosen["cacheblend@1"] is configs["cacheblend@1"]
    with pytest.raises(ValueError, match=r"unknown configurations \['cacheblend@0.2', 'bogus'\]"):
        select_configurations(configs, ["cacheblend@0.2", "bogus", "none"])


def test_paired_comparison_counts_discordant_pairs_and_brackets_the_difference():
    reference = [1.0, 0.0, 1.0, 0.0, 0.0] * 4
    correct = [1.0, 1.0, 0.0, 1.0, 0.0] * 4  # 8 gained, 4 lost of 20: difference +0.2
    stats = paired_comparison(correct, reference, resamples=2000, seed=3)
    assert (stats["gained"], stats["lost"]) == (8.0, 4.0)
    # exact McNemar: 2 * P(Binomial(12, 1/2) <= 4) = 2 * (1 + 12 + 66 + 220 + 495) / 4096
    assert stats["mcnemar_p"] == pytest.approx(2 * 794 / 4096)
    # normal approximation: 0.2 +- 1.96 * sqrt((12 / 20 - 0.2**2) / 20) = [-0.13, 0.53]
    assert stats["diff_low"] == pytest.approx(-0.13, abs=0.06) and stats["diff_high"] == pytest.approx(0.53, abs=0.06)
    assert paired_comparison(correct, reference, resamples=2000, seed=3) == stats
    same = paired_comparison(reference, reference, resamples=100)
    assert same == {"gained": 0.0, "lost": 0.0, "mcnemar_p": 1.0, "diff_low": 0.0, "diff_high": 0.0}
    # all discordant pairs one way: 10 gained, 0 lost -> p = 2 / 2**10, interval above 0
    stats = paired_comparison([1.0] * 10 + [0.0] * 10, [0.0] * 20, resamples=1000)
    assert stats["mcnemar_p"] == pytest.approx(2 / 1024) and stats["diff_low"] > 0.0
    with pytest.raises(ValueError, match="equally many"):
        paired_comparison([1.0], [1.0, 0.0])


def test_paired_against_removes_the_questions_own_spread():
    """Two configurations whose gold log-probabilities differ by exactly 0.1 on every question, while the
    questions themselves spread over 10 units: the paired interval is the point +0.1; unpaired means could not
    resolve it."""
    spread = [float(10 * (i % 3)) for i in range(30)]
    rows = {
        FULL: [{"gold_logprob": s, "agrees_with_full": 1.0} for s in spread],
        DEFAULT_REPAIR: [{"gold_logprob": s - 1.0, "agrees_with_full": float(i % 2)} for i, s in enumerate(spread)],
        "other": [{"gold_logprob": s - 0.9, "agrees_with_full": 1.0} for s in spread],
    }
    paired = paired_against(rows, DEFAULT_REPAIR)
    assert set(paired) == {FULL, "other"}
    other = paired["other"]
    assert other["logprob_diff"] == pytest.approx(0.1)
    assert other["logprob_low"] == pytest.approx(0.1) and other["logprob_high"] == pytest.approx(0.1)
    assert other["agree_diff"] == pytest.approx(0.5) and 0.2 < other["agree_diff_low"] < 0.5 < other["agree_diff_high"]
    assert paired[FULL]["logprob_diff"] == pytest.approx(1.0)
    text = "\n".join(paired_table(DEFAULT_REPAIR, paired))
    assert f"paired with {DEFAULT_REPAIR}" in text and "[+0.100, +0.100]" in text
    assert paired_table(None, {}) == []
    with pytest.raises(ValueError, match="unknown reference"):
        paired_against(rows, "missing")


def test_ape_variants_are_added_to_their_bases():
    import argparse

    from kvboost_hf.bench.rag_accuracy import temperature_and_scale, with_context_adjustment

    configs = configurations(ratios=(0.15,), method_names=("selective",))
    adjusted = with_context_adjustment(configs, ((0.8, 1.0), (1.0, 1.2)), ("none", DEFAULT_REPAIR))
    assert list(adjusted)[: len(configs)] == list(configs)
    assert adjusted["none+ape0.8/1"] == RepairConfig("none", 0.0, context_temperature=0.8)
    assert adjusted[f"{DEFAULT_REPAIR}+ape1/1.2"] == RepairConfig(context_scale=1.2)
    assert with_context_adjustment(configs, (), ()) == configs
    with pytest.raises(ValueError, match="unknown base"):
        with_context_adjustment(configs, ((0.8, 1.0),), (FULL,))
    assert temperature_and_scale("0.9/1.1") == (0.9, 1.1)
    for bad in ("0.9", "a/b", "0/1"):
        with pytest.raises(argparse.ArgumentTypeError):
            temperature_and_scale(bad)


def test_default_repair_is_the_library_default():
    assert configurations(ratios=(0.15,), method_names=("selective",))[DEFAULT_REPAIR] == RepairConfig()


def test_report_and_plot_show_the_paired_statistics_and_the_target(tmp_path):
    def row(agree, speedup, delta=(-0.1, -0.2, 0.0)):
        return {
            "correct": 0.7, "agrees_with_full": agree, "ttft_ms": 1000.0 / speedup, "speedup": speedup, "kl": 0.0,
            "greedy_match": 6.0, "reused_tokens": 0.0, "recomputed_tokens": 0.0, "prompt_tokens": 400.0,
            "gained": 2.0, "lost": 3.0, "mcnemar_p": 0.5, "diff_low": -0.15, "diff_high": 0.05,
            "gold_logprob": -1.0, "gold_logprob_delta": delta[0], "delta_low": delta[1], "delta_high": delta[2],
            "kl_answer": 0.01, "agree_low": agree - 0.04, "agree_high": min(1.0, agree + 0.03),
        }  # fmt: skip

    configs = {
        FULL: row(1.0, 1.0, (0.0, 0.0, 0.0)),
        "none": row(0.75, 6.0),
        "cacheblend@0.15": row(0.96, 4.0),
        "cacheblend@0.3": row(1.0, 3.2),
        "cacheblend@1": row(1.0, 0.9),
        "cacheblend@0.2": row(0.9, 3.5, (0.001, -0.01, 0.02)),
        "cacheblend@0.2+ape0.9/1": row(0.9, 3.4),
        NOISE: row(1.0, 0.5, (0.0, -0.01, 0.01)) | {"max_abs_delta": 0.03},
    }
    from kvboost_hf.bench.rag_accuracy import target_check

    target = target_check(configs)
    assert target == {
        "met": ["cacheblend@0.15", "cacheblend@0.3"],
        "resolved": ["cacheblend@0.3"],
        "noise_band": 0.03,
        "within_noise": ["cacheblend@0.2"],  # its interval [-0.01, 0.02] lies inside +-0.03; the others reach -0.2
        "best": "cacheblend@0.3",
    }
    result = {
        "configs": configs,
        "settings": {"questions": 20},
        "model": "m",
        "machine": {"device": "cpu"},
        "target": target,
    }
    text = report(result)
    assert "+2/-3" in text and "[-0.200, +0.000]" in text and "[92, 99]" in text and "resolved" in text
    assert "noise band" in text and "+-0.03" in text and "['cacheblend@0.2']" in text
    plot(result, tmp_path / "rag.png")
    assert (tmp_path / "rag.png").stat().st_size > 0
    slow = target_check({FULL: configs[FULL], "slow": row(1.0, 2.0)})
    assert slow == {"met": [], "resolved": [], "noise_band": None, "within_noise": [], "best": None}


@pytest.mark.slow
def test_teacher_forced_log_probabilities_follow_the_loaded_kv(embedded_engine):
    """Full prefill gives the model's own next-token log-probabilities along the continuation; reuse at ratio 1
    recomputes everything and gives the same; reuse without repair loads the shuffled documents' stored K/V as they
    were, so the distribution moves (KL > 0) while the gold answer is still scored on the same tokens."""
    from kvboost_hf.bench.rag_accuracy import continuous_measures, mean_kl, teacher_forced, teacher_forced_batched

    engine = embedded_engine
    documents, questions = build_questions(3, 2, 1, seed=2, chars=300)
    for doc in documents:
        engine.warm(doc)
    question = questions[0]
    continuation = engine.tokenizer(" " + question.answer + ".", add_special_tokens=False)["input_ids"]
    full, shorter = teacher_forced(engine, question.segments, [continuation, continuation[:2]], None)
    torch.testing.assert_close(shorter, full[:2], atol=1e-4, rtol=0)  # the prompt cache was cropped back
    ids = torch.tensor([engine.encode(question.segments) + continuation])
    with torch.no_grad():
        own = engine.model(ids).logits[0, -len(continuation) - 1 : -1].float().log_softmax(-1)
    assert full.shape == (len(continuation), engine.model.config.vocab_size)
    torch.testing.assert_close(full, own, atol=1e-4, rtol=0)
    (recomputed,) = teacher_forced(engine, question.segments, [continuation], RepairConfig("cacheblend", 1.0))
    assert mean_kl(full, recomputed) < 1e-6 and mean_kl(full, full) == 0.0
    (stale,) = teacher_forced(engine, question.segments, [continuation], RepairConfig("none", 0.0))
    assert mean_kl(full, stale) > 1e-4
    gold, along_answer = continuous_measures(
        engine, question, continuation, lambda texts: teacher_forced(engine, question.segments, texts, None)
    )
    gold_ids = engine.tokenizer(" " + question.answer, add_special_tokens=False)["input_ids"]
    assert gold == pytest.approx(float(sum(full[i, t] for i, t in enumerate(gold_ids))), abs=1e-4)
    torch.testing.assert_close(along_answer, full, atol=1e-4, rtol=0)
    # the noise reference: the same prompt as row 0 of a left-padded batch gives the same distribution up to
    # floating-point summation order
    (batched,) = teacher_forced_batched(engine, question.segments, [continuation])
    torch.testing.assert_close(batched, full, atol=1e-3, rtol=0)
    engine.store.clear()
