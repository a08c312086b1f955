"""``python -m kvboost_hf.bench rag_accuracy``: task accuracy of approximate (non-prefix) reuse on RAG questions.

Documents of real text (:func:`kvboost_hf.corpus.fact_documents`: standard-library documentation with planted
sentences such as "The access code of the north archive is 4821.", ``--facts-per-doc`` per document) are warmed
once each with ``engine.warm``. Each question is a prompt of segments: a system header, ``--docs-per-query``
documents in shuffled order (one holds the answer, the others are distractors with facts of the same form) and
the question, whose answer is already started ("The document that mentions the north archive says: The access
code of the north archive is") so that even a 135M model answers with a code. The answer is scored by exact match
of the first number generated (greedy, ``--new-tokens`` tokens).

Side by side in one run, for every question: full prefill (``mode="baseline"``), ``none``, each of ``--methods``
at each ``--ratios`` (per-call ``repair=RepairConfig(...)``; :func:`methods`: selective, one-shot CacheBlend on
keys or values, the paper's gradual filtering, each with chunk heads recomputed too) and chunk-start realignment
alone for each ``--realign-tokens`` K, each from the same store (the warmed documents only), in rotating order.
Per configuration: accuracy,
agreement with the full prefill's answer, TTFT and its speed-up over full prefill, first-token KL(full || reuse),
greedy tokens agreeing, and two continuous measures, paired per question against full prefill on the same prompt,
that resolve differences exact match cannot: the teacher-forced log-probability of the gold answer (its tokens
fed after the prompt whose K/V the configuration loaded and repaired; the difference from full prefill's, mean
and bootstrap 95% interval) and the mean KL(full || reuse) over the first ``KL_POSITIONS`` positions of full
prefill's own answer, teacher-forced the same way. The target (issue 19): answers identical to full prefill's on
>= 95% of questions at >= 3x its TTFT. Writes ``rag_accuracy.json`` and ``rag_accuracy.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.rag import compare
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import RepairConfig
from kvboost_hf.corpus import Fact, fact_documents
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.attention import ATTN_IMPLEMENTATION
from kvboost_hf.hf.decode import left_pad
from kvboost_hf.hf.prefill import forward
from kvboost_hf.results import GenerationResult
from kvboost_hf.store.chunk_store import ChunkStore

RATIOS = (0.05, 0.15, 0.3, 0.5, 1.0)
FULL = "full prefill"
HEADER = (
    "<|im_start|>system\nYou are a helpful assistant. Answer the question using the documents.<|im_end|>\n"
    "<|im_start|>user\n"
)
TARGET = {"min_agreement": 0.95, "min_speedup": 3.0}
KL_POSITIONS = 8
DEFAULT_REPAIR = "selective@0.15"
"""The library's default approximate configuration (``RepairConfig()``), the usual reference of paired tables."""
NOISE = "full prefill, batched"
"""Full prefill again, as the first row of a left-padded batch of two beside a longer companion prompt: the same
computation in exact arithmetic, other shapes and summation orders in floating point. Its differences from full
prefill are the noise band of every measure."""
COMPANION_EXTRA_TOKENS = 16
METHOD_HELP = "selective, cacheblend, cacheblend-V, cacheblend-gradualN, cacheblend+headsK, cacheblend-gradualN+headsK"


@dataclass(frozen=True)
class Question:
    """A prompt as segments (header, shuffled documents, question) and the expected answer (a string)."""

    segments: list[str]
    answer: str


def document_segment(text: str) -> str:
    return f"Document: {text}\n\n"


def question_segment(fact: Fact) -> str:
    """The question, then the assistant turn already started: it names the place once more and repeats the fact's
    own words up to the answer (the 135M model picks the right document more often when the place is restated:
    63-67% instead of 47-50% over 30 questions with 3 one-fact documents per prompt)."""
    return (
        f"Question: {fact.question} Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
        f"The document that mentions the {fact.place} says: The access code of the {fact.place} is"
    )


def build_questions(
    num_docs: int,
    docs_per_query: int,
    count: int,
    facts_per_doc: int = 1,
    seed: int = 0,
    chars: int = 800,
    source_chars: int | None = None,
) -> tuple[list[str], list[Question]]:
    """The document segments to warm and ``count`` questions over shuffled subsets of them (deterministic; see
    :func:`~kvboost_hf.corpus.fact_documents` for ``chars`` and ``source_chars``)."""
    if not 1 <= docs_per_query <= num_docs:
        raise ValueError(f"docs_per_query must be in [1, num_docs={num_docs}], got {docs_per_query}")
    docs = fact_documents(num_docs, facts_per_doc, chars, seed, source_chars)
    segments = [document_segment(text) for text, _ in docs]
    rng = random.Random(seed)
    questions = []
    for index in range(count):
        chosen = rng.sample(range(num_docs), docs_per_query)
        holder = chosen[index % docs_per_query]  # the answer's document takes every place in turn
        fact = docs[holder][1][rng.randrange(facts_per_doc)]
        questions.append(Question([HEADER, *(segments[i] for i in chosen), question_segment(fact)], fact.answer))
    return segments, questions


def extract_answer(text: str) -> str:
    """The first run of digits in ``text`` ('' if none): what is compared, exactly, with the expected answer."""
    match = re.search(r"\d+", text)
    return match.group() if match else ""


def methods(head_tokens: int = 16, filter_layers: int = 4) -> dict[str, Callable[[float], RepairConfig]]:
    """Every repair method by name, as its configuration at a ratio (issue 19's list): the baselines
    ``selective`` and one-shot ``cacheblend`` (keys at layer 1, as LMCache), ``cacheblend-V`` (values, as the
    public CacheBlend code), ``cacheblend-gradual`` (the paper's gradual filtering over ``filter_layers``
    layers), ``+heads`` (the first ``head_tokens`` of every reused chunk recomputed at every layer, counted in
    the ratio: chunk-start realignment combined with CacheBlend)."""
    gradual = f"cacheblend-gradual{filter_layers}"
    heads = f"+heads{head_tokens}"
    return {
        "selective": lambda r: RepairConfig("selective", r),
        "cacheblend": lambda r: RepairConfig("cacheblend", r),
        "cacheblend-V": lambda r: RepairConfig("cacheblend", r, deviation="value"),
        gradual: lambda r: RepairConfig("cacheblend", r, filter_layers=filter_layers),
        f"cacheblend{heads}": lambda r: RepairConfig("cacheblend", r, head_tokens=head_tokens),
        f"{gradual}{heads}": lambda r: RepairConfig(
            "cacheblend", r, filter_layers=filter_layers, head_tokens=head_tokens
        ),
    }


def configurations(
    ratios: tuple[float, ...] = RATIOS,
    method_names: tuple[str, ...] = ("selective", "cacheblend"),
    realign_tokens: tuple[int, ...] = (),
    head_tokens: int = 16,
    filter_layers: int = 4,
) -> dict[str, RepairConfig | None]:
    """Full prefill (``None``), ``none``, each of ``method_names`` (:func:`methods`) at ``ratios``, and
    chunk-start realignment alone (``realignK``: the first K tokens of every reused chunk, nothing else) for each
    K of ``realign_tokens``."""
    known = methods(head_tokens, filter_layers)
    if unknown := [name for name in method_names if name not in known]:
        raise ValueError(f"unknown methods {unknown}: choose from {list(known)}")
    configs: dict[str, RepairConfig | None] = {FULL: None, "none": RepairConfig("none", 0.0)}
    for name in method_names:
        for ratio in ratios:
            configs[f"{name}@{ratio:g}"] = known[name](ratio)
    for tokens in realign_tokens:
        configs[f"realign{tokens}"] = RepairConfig("selective", 0.0, overlap_k=0, head_tokens=tokens)
    return configs


def with_context_adjustment(
    configs: dict[str, RepairConfig | None], pairs: tuple[tuple[float, float], ...], bases: tuple[str, ...] = ("none",)
) -> dict[str, RepairConfig | None]:
    """``configs`` plus, for each base configuration and each ``(T, S)`` of ``pairs``, the base with APE's
    attention temperature ``T`` and scaling factor ``S`` on the reused documents (``base+apeT/S``)."""
    if unknown := [base for base in bases if configs.get(base) is None]:
        raise ValueError(f"unknown base configurations {unknown}: choose from {[n for n, c in configs.items() if c]}")
    adjusted = dict(configs)
    for base in bases:
        config = configs[base]
        assert config is not None
        for temperature, scale in pairs:
            adjusted[f"{base}+ape{temperature:g}/{scale:g}"] = replace(
                config, context_temperature=temperature, context_scale=scale
            )
    return adjusted


def select_configurations(configs: dict[str, RepairConfig | None], names: list[str]) -> dict[str, RepairConfig | None]:
    """The configurations named in ``names`` (``strategy@ratio``, ratios compared as numbers: ``cacheblend@1.0``
    is ``cacheblend@1``), full prefill always included first (it is every comparison's reference)."""

    def canonical(name: str) -> str:
        strategy, at, ratio = name.partition("@")
        try:
            return f"{strategy}@{float(ratio):g}" if at else name
        except ValueError:
            return name

    wanted = [canonical(name) for name in names]
    unknown = [name for name, key in zip(names, wanted, strict=True) if key not in configs]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}: choose from {list(configs)}")
    return {name: configs[name] for name in configs if name == FULL or name in wanted}


def bootstrap_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values``: resampled with replacement ``resamples`` times
    from ``random.Random(seed)`` (deterministic)."""
    rng = random.Random(seed)
    count = len(values)
    means = sorted(sum(rng.choices(values, k=count)) / count for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]


def paired_comparison(
    correct: list[float], reference: list[float], resamples: int = 10_000, seed: int = 0
) -> dict[str, float]:
    """Paired statistics of per-question scores (1.0 right, 0.0 wrong) against a reference's on the same questions.

    ``gained``: questions right here and wrong in the reference; ``lost``: the reverse (McNemar's discordant
    pairs); ``mcnemar_p``: exact two-sided McNemar p-value (binomial(gained + lost, 1/2) on the discordant
    pairs; 1.0 when there are none); ``diff_low``/``diff_high``: percentile bootstrap 95% interval of the accuracy
    difference (this minus reference), questions resampled with replacement ``resamples`` times from
    ``random.Random(seed)`` (deterministic)."""
    if len(correct) != len(reference) or not correct:
        raise ValueError(f"need equally many (> 0) scores, got {len(correct)} and {len(reference)}")
    deltas = [a - b for a, b in zip(correct, reference, strict=True)]
    gained, lost = deltas.count(1.0), deltas.count(-1.0)
    discordant = gained + lost
    tail = sum(math.comb(discordant, k) for k in range(min(gained, lost) + 1)) / 2**discordant
    low, high = bootstrap_interval(deltas, resamples, seed)
    return {
        "gained": float(gained),
        "lost": float(lost),
        "mcnemar_p": min(1.0, 2 * tail),
        "diff_low": low,
        "diff_high": high,
    }


TeacherForcing = Callable[[list[list[int]]], list[torch.Tensor]]
"""Continuations -> their teacher-forced log-probabilities after one question's prompt, under one configuration."""


def teacher_forced(
    engine: InferenceEngine, segments: list[str], continuations: list[list[int]], repair: RepairConfig | None
) -> list[torch.Tensor]:
    """For each continuation, the log-probabilities ``[len(continuation), V]`` (fp32, CPU) of each next token
    while it is fed after the prompt ``segments``, whose K/V are loaded and repaired from the store once, as
    ``repair`` says (None: full prefill). Continuations are always computed, one after the other from the same
    prompt cache (cropped back after each); nothing is written back."""
    prompt, starts = engine.encode_segments(segments)
    mode = "baseline" if repair is None else "chunk_kv_reuse"
    cache = engine.new_cache(mode, None, starts, repair, adapter=False)
    logprobs = []
    with engine.lock:
        model = engine.model
        last = forward(model, cache, input_ids=torch.tensor([prompt], device=engine.device), logits_to_keep=1).logits
        for continuation in continuations:
            fed = torch.tensor([continuation], device=engine.device)
            logits = forward(model, cache, input_ids=fed, logits_to_keep=len(continuation)).logits
            cache.crop(-len(continuation))
            logprobs.append(torch.cat([last[0], logits[0, :-1]]).float().log_softmax(-1).cpu())
    return logprobs


def companion(prompt: list[int]) -> list[int]:
    """The longer prompt beside which :data:`NOISE` computes ``prompt`` (so that row gets left padding)."""
    return prompt + prompt[:COMPANION_EXTRA_TOKENS]


def teacher_forced_batched(
    engine: InferenceEngine, segments: list[str], continuations: list[list[int]]
) -> list[torch.Tensor]:
    """:func:`teacher_forced` with full prefill computed as :data:`NOISE` computes it (row 0 of a padded batch)."""
    prompt = engine.encode(segments)
    logprobs = []
    for continuation in continuations:
        ids, mask = left_pad(
            [prompt + continuation, companion(prompt) + continuation], engine.prompts.pad_token_id, engine.device
        )
        with engine.lock, torch.inference_mode():
            logits = engine.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                logits_to_keep=len(continuation) + 1,
            ).logits
        logprobs.append(logits[0, :-1].float().log_softmax(-1).cpu())
    return logprobs


def continuous_measures(
    engine: InferenceEngine, question: Question, full_answer: list[int], forced: TeacherForcing
) -> tuple[float, torch.Tensor]:
    """The gold answer's teacher-forced log-probability (sum over its tokens) and the log-probabilities along the
    first ``KL_POSITIONS`` tokens of full prefill's answer, ``forced`` by one configuration."""
    gold = engine.tokenizer(" " + question.answer, add_special_tokens=False)["input_ids"]
    gold_logprobs, answer_logprobs = forced([gold, full_answer[:KL_POSITIONS]])
    return float(gold_logprobs.gather(1, torch.tensor(gold)[:, None]).sum()), answer_logprobs


def mean_kl(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || logprobs), both ``[positions, V]`` log-probabilities."""
    return float((reference.exp() * (reference - logprobs)).sum(-1).mean())


class StoreSnapshot:
    """The keys of the store's RAM tier at creation; :meth:`restore` deletes every key added since, so each
    configuration starts from the warmed documents only (write-back of one would otherwise help the next). Both
    flush the store first: chunks still landing are in RAM then."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        store.flush()
        self.keys = {key for key, _ in store.ram.items()}

    def restore(self) -> None:
        self.store.flush()
        for key, _ in self.store.ram.items():
            if key not in self.keys:
                self.store.ram.delete(key)


def answer_question(
    engine: InferenceEngine,
    question: Question,
    configs: dict[str, RepairConfig | None],
    order: list[str],
    snapshot: StoreSnapshot,
    new_tokens: int,
    noise: bool = True,
) -> dict[str, dict[str, float]]:
    """One question under every configuration (in ``order``, the store restored after each), then with ``noise``
    as :data:`NOISE`: the per-question measures that :func:`evaluate` averages."""
    results: dict[str, GenerationResult] = {}
    forcing: dict[str, TeacherForcing] = {}
    for name in order:
        repair = configs[name]
        results[name] = engine.generate(
            question.segments,
            max_new_tokens=new_tokens,
            mode="baseline" if repair is None else "chunk_kv_reuse",
            logprobs=0,
            repair=repair,
        )
        forcing[name] = functools.partial(teacher_forced, engine, question.segments, repair=repair)
        snapshot.restore()
    if noise:
        prompt = engine.encode(question.segments)
        results[NOISE] = engine.generate_batch([prompt, companion(prompt)], new_tokens, "baseline", logprobs=0)[0]
        forcing[NOISE] = functools.partial(teacher_forced_batched, engine, question.segments)
    reference = results[FULL]
    measures = {name: continuous_measures(engine, question, reference.output_ids, forcing[name]) for name in results}
    full_gold, full_answer = measures[FULL]
    rows = {}
    for name, result in results.items():
        answer = extract_answer(result.output_text)
        gold_logprob, answer_logprobs = measures[name]
        rows[name] = compare(result, reference) | {
            "correct": float(answer == question.answer),
            "agrees_with_full": float(answer == extract_answer(reference.output_text)),
            "prompt_tokens": float(result.prompt_tokens),
            "gold_logprob": gold_logprob,
            "gold_logprob_delta": gold_logprob - full_gold,
            "kl_answer": mean_kl(full_answer, answer_logprobs),
        }
    return rows


Rows = dict[str, list[dict[str, float]]]
"""Per configuration, one row of :func:`answer_question`'s measures per question (questions in the same order)."""


def evaluate(
    engine: InferenceEngine,
    documents: list[str],
    questions: list[Question],
    configs: dict[str, RepairConfig | None],
    new_tokens: int = 6,
    noise: bool = True,
    warm_after_header: bool = False,
) -> dict[str, dict[str, float]]:
    """:func:`summarize` of :func:`answer_all`."""
    return summarize(answer_all(engine, documents, questions, configs, new_tokens, noise, warm_after_header))


def answer_all(
    engine: InferenceEngine,
    documents: list[str],
    questions: list[Question],
    configs: dict[str, RepairConfig | None],
    new_tokens: int = 6,
    noise: bool = True,
    warm_after_header: bool = False,
) -> Rows:
    """Warm ``documents`` (and the header; with ``warm_after_header`` each document after the header, APE's shared
    prefix: its K/V then saw the text every prompt starts with instead of a start of its own), then answer every
    question under every configuration (in rotating order; with ``noise`` also as :data:`NOISE`)."""
    engine.warm(HEADER)
    for doc in documents:
        engine.warm([HEADER, doc] if warm_after_header else doc)
    snapshot = StoreSnapshot(engine.store)
    engine.generate(HEADER + "warm-up", max_new_tokens=2, mode="baseline")
    rows: Rows = {name: [] for name in [*configs, *([NOISE] if noise else [])]}
    names = list(configs)
    for index, question in enumerate(tqdm(questions, desc="questions")):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name, row in answer_question(engine, question, configs, order, snapshot, new_tokens, noise).items():
            rows[name].append(row)
    return rows


def summarize(rows: Rows) -> dict[str, dict[str, float]]:
    """The means per configuration: ``correct`` (accuracy), ``agrees_with_full`` (same answer as the full
    prefill), ``speedup`` (mean full-prefill TTFT over mean TTFT) and :func:`kvboost_hf.bench.rag.compare`'s
    ``ttft_ms``, ``top1_agree``, ``kl`` (first token, full || reuse), ``greedy_match`` (tokens),
    ``reused_tokens`` and ``recomputed_tokens``; ``gold_logprob`` and ``gold_logprob_delta`` (minus full
    prefill's, per question; with its bootstrap interval ``delta_low``/``delta_high``), ``kl_answer`` (mean KL
    over the first ``KL_POSITIONS`` positions of full prefill's answer), the agreement's interval
    ``agree_low``/``agree_high``; :func:`paired_comparison` of each configuration's answers with the full
    prefill's (``gained``, ``lost``, ``mcnemar_p``, ``diff_low``, ``diff_high``); and for :data:`NOISE`
    ``max_abs_delta``, the largest gold log-probability change an equivalent computation made on any question."""
    summary = {
        name: {key: statistics.fmean(r[key] for r in values) for key in values[0]} for name, values in rows.items()
    }
    reference_scores = [r["correct"] for r in rows[FULL]]
    for name, row in summary.items():
        row["speedup"] = summary[FULL]["ttft_ms"] / row["ttft_ms"]
        row |= paired_comparison([r["correct"] for r in rows[name]], reference_scores)
        row["delta_low"], row["delta_high"] = bootstrap_interval([r["gold_logprob_delta"] for r in rows[name]])
        row["agree_low"], row["agree_high"] = bootstrap_interval([r["agrees_with_full"] for r in rows[name]])
    if NOISE in rows:
        summary[NOISE]["max_abs_delta"] = max(abs(r["gold_logprob_delta"]) for r in rows[NOISE])
    return summary


def paired_against(rows: Rows, reference: str) -> dict[str, dict[str, float]]:
    """Every configuration against ``reference`` on the same questions: the mean and bootstrap 95% interval of
    the per-question differences (this minus reference) of the gold answer's log-probability
    (``logprob_diff``, ``logprob_low``, ``logprob_high``) and of agreement with full prefill (``agree_diff``,
    ``agree_diff_low``, ``agree_diff_high``). Pairing removes the questions' own spread, which dominates the
    unpaired intervals of two methods' means."""
    if reference not in rows:
        raise ValueError(f"unknown reference configuration {reference!r}: choose from {list(rows)}")
    paired = {}
    for name, values in rows.items():
        if name == reference:
            continue
        logprob = [a["gold_logprob"] - b["gold_logprob"] for a, b in zip(values, rows[reference], strict=True)]
        agree = [a["agrees_with_full"] - b["agrees_with_full"] for a, b in zip(values, rows[reference], strict=True)]
        (logprob_low, logprob_high), (agree_low, agree_high) = bootstrap_interval(logprob), bootstrap_interval(agree)
        paired[name] = {
            "logprob_diff": statistics.fmean(logprob),
            "logprob_low": logprob_low,
            "logprob_high": logprob_high,
            "agree_diff": statistics.fmean(agree),
            "agree_diff_low": agree_low,
            "agree_diff_high": agree_high,
        }
    return paired


def target_check(summary: dict[str, dict[str, float]]) -> dict[str, object]:
    """The target (issue 19): answers identical to full prefill's on >= 95% of questions at >= 3x its TTFT, with
    the gold answer's log-probability change inside the noise band.

    ``met``: the configurations whose point estimates meet agreement and speed; ``resolved``: those whose
    agreement interval's low end is also >= 95% (the sample resolves it); ``noise_band``: :data:`NOISE`'s largest
    absolute change (None without it); ``within_noise``: the fast configurations whose change's 95% interval lies
    inside +-``noise_band``; ``best``: the configuration of highest agreement among those at >= 3x (None if none
    is that fast)."""
    fast = {
        name: row
        for name, row in summary.items()
        if name not in (FULL, NOISE) and row["speedup"] >= TARGET["min_speedup"]
    }
    met = [name for name, row in fast.items() if row["agrees_with_full"] >= TARGET["min_agreement"]]
    band = summary[NOISE]["max_abs_delta"] if NOISE in summary else None
    return {
        "met": met,
        "resolved": [name for name in met if summary[name]["agree_low"] >= TARGET["min_agreement"]],
        "noise_band": band,
        "within_noise": [
            name
            for name, row in fast.items()
            if band is not None and -band <= row["delta_low"] <= row["delta_high"] <= band
        ],
        "best": max(fast, key=lambda name: (fast[name]["agrees_with_full"], fast[name]["speedup"]), default=None),
    }


def run(args: argparse.Namespace, engine: InferenceEngine | None = None) -> dict:
    """The whole benchmark; pass ``engine`` to reuse a loaded one (its store is cleared first)."""
    documents, questions = build_questions(
        args.docs, args.docs_per_query, args.questions, args.facts_per_doc, args.seed, args.doc_chars, args.source_chars
    )
    configs = configurations(
        tuple(args.ratios), tuple(args.methods), tuple(args.realign_tokens), args.head_tokens, args.filter_layers
    )
    if args.configs:
        configs = select_configurations(configs, args.configs)
    configs = with_context_adjustment(configs, tuple(args.ape), tuple(args.ape_on) if args.ape else ())
    if engine is None:
        engine = InferenceEngine.from_pretrained(chunking=args.chunk_size)
    if any(config is not None and config.adjusts_attention for config in configs.values()):
        engine.model.set_attn_implementation(ATTN_IMPLEMENTATION)  # the adjustment's attention path
    engine.store.clear()
    rows = answer_all(
        engine,
        documents,
        questions,
        configs,
        args.new_tokens,
        noise=args.noise,
        warm_after_header=args.warm_after_header,
    )
    summary = summarize(rows)
    reference = args.pair_with if args.pair_with in rows else None
    return {
        "benchmark": "rag_accuracy",
        "machine": machine_info(engine.device),
        "model": engine.model.config._name_or_path,
        "settings": vars(args) | {"out": str(args.out), "chunk_size": engine.chunking.chunk_size},
        "configs": summary,
        "target": target_check(summary),
        "paired_with": reference,
        "paired": paired_against(rows, reference) if reference else {},
        "per_question": {
            "answers": [question.answer for question in questions],
            "rows": rows,
        },
    }


def table(configs: dict[str, dict[str, float]]) -> list[str]:
    """One text line per configuration of an :func:`evaluate` summary, under a header line."""
    lines = [
        f"{'config':<24} {'agree':>6} {'agree 95% CI':>13} {'speed-up':>8} {'TTFT ms':>8} {'gold lp delta':>13} "
        f"{'delta 95% CI':>15} {'KL@8':>7} {'accuracy':>8} {'+/-':>7} {'diff 95% CI':>12} {'reused':>7} "
        f"{'recomputed':>10}"
    ]
    for name, row in configs.items():
        agree = f"[{100 * row['agree_low']:.0f}, {100 * row['agree_high']:.0f}]"
        delta = f"[{row['delta_low']:+.3f}, {row['delta_high']:+.3f}]"
        diff = f"[{100 * row['diff_low']:+.0f}, {100 * row['diff_high']:+.0f}]"
        discordant = f"+{row['gained']:.0f}/-{row['lost']:.0f}"
        lines.append(
            f"{name:<24} {row['agrees_with_full']:>6.0%} {agree:>13} {row['speedup']:>7.2f}x {row['ttft_ms']:>8.0f} "
            f"{row['gold_logprob_delta']:>+13.3f} {delta:>15} {row['kl_answer']:>7.4f} {row['correct']:>8.0%} "
            f"{discordant:>7} {diff:>12} {row['reused_tokens']:>7.0f} {row['recomputed_tokens']:>10.0f}"
        )
    return lines


def report(result: dict) -> str:
    target = result["target"]
    return "\n".join(
        [
            f"{len(result['configs'])} configurations x {result['settings']['questions']} questions, "
            f"{result['configs'][FULL]['prompt_tokens']:.0f} prompt tokens on average",
            *table(result["configs"]),
            f"target (answers identical to full prefill's on >= {TARGET['min_agreement']:.0%} of questions at >= "
            f"{TARGET['min_speedup']:g}x TTFT): met by {target['met'] or 'none'} on the point estimates, resolved "
            f"(interval above the target) for {target['resolved'] or 'none'}; most agreeing at >= "
            f"{TARGET['min_speedup']:g}x: {target['best']}",
            noise_line(target),
            *paired_table(result.get("paired_with"), result.get("paired", {})),
        ]
    )


def paired_table(reference: str | None, paired: dict[str, dict[str, float]]) -> list[str]:
    """Text lines of :func:`paired_against`'s result (none without a reference)."""
    if reference is None:
        return []
    lines = [f"paired with {reference} (this minus it, per question; 95% intervals):",
             f"{'config':<24} {'gold lp diff':>12} {'95% CI':>17} {'agree diff':>10} {'95% CI':>12}"]  # fmt: skip
    for name, row in paired.items():
        logprob = f"[{row['logprob_low']:+.3f}, {row['logprob_high']:+.3f}]"
        agree = f"[{100 * row['agree_diff_low']:+.0f}, {100 * row['agree_diff_high']:+.0f}]"
        lines.append(
            f"{name:<24} {row['logprob_diff']:>+12.3f} {logprob:>17} {100 * row['agree_diff']:>+9.0f}% {agree:>12}"
        )
    return lines


def noise_line(target: dict) -> str:
    band = target.get("noise_band")
    if band is None:
        return f"no noise band measured ('{NOISE}' not run)"
    return (
        f"noise band (largest |gold log-prob change| of '{NOISE}' on any question): +-{band:.2g}; fast "
        f"configurations whose change's 95% interval lies inside it: {target['within_noise'] or 'none'}"
    )


def plot_pareto(result: dict, axes: tuple) -> None:
    """Agreement with full prefill, and the gold answer's log-probability change (95% interval), against the TTFT
    speed-up: one line per method over its ratios; no repair, realignment alone and APE's adjustments as points
    (onto two axes)."""
    ax_agree, ax_delta = axes
    configs = result["configs"]
    curves = {name for name in configs if "@" in name and "+ape" not in name}
    for method in sorted({name.split("@")[0] for name in curves}):
        points = sorted((float(n.split("@")[1]), configs[n]) for n in curves if n.split("@")[0] == method)
        speed = [row["speedup"] for _, row in points]
        ax_agree.plot(speed, [row["agrees_with_full"] for _, row in points], marker="o", label=method)
        deltas = [row["gold_logprob_delta"] for _, row in points]
        errors = [
            [max(0.0, d - row["delta_low"]) for d, (_, row) in zip(deltas, points, strict=True)],
            [max(0.0, row["delta_high"] - d) for d, (_, row) in zip(deltas, points, strict=True)],
        ]
        ax_delta.errorbar(speed, deltas, yerr=errors, marker="o", capsize=3, label=method)
        for ratio, row in points:
            ax_agree.annotate(f"{ratio:g}", (row["speedup"], row["agrees_with_full"]), fontsize=7)
    singles = {
        name: row
        for name, row in configs.items()
        if name in ("none", NOISE) or name.startswith("realign") or "+ape" in name
    }
    for name, row in singles.items():
        for ax, key in ((ax_agree, "agrees_with_full"), (ax_delta, "gold_logprob_delta")):
            marker = {"none": "k*", NOISE: "kx"}.get(name, "s")
            ax.plot([row["speedup"]], [row[key]], marker, markersize=9, label=name)
    ax_agree.axhline(TARGET["min_agreement"], color="red", linestyle=":", label="target agreement")
    ax_agree.axvline(TARGET["min_speedup"], color="red", linestyle=":")
    ax_delta.axhline(0.0, color="black")
    ax_agree.set(
        xlabel="TTFT speed-up over full prefill", ylabel="answer identical to full prefill", ylim=(-0.02, 1.02)
    )
    ax_delta.set(xlabel="TTFT speed-up over full prefill", ylabel="gold answer log-prob - full prefill's (95% CI)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_pareto(result, axes)
    fig.suptitle(f"RAG accuracy under reuse, {result['model'].split('/')[-1]} ({result['machine']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def temperature_and_scale(text: str) -> tuple[float, float]:
    """``"T/S"`` -> ``(T, S)``, both positive numbers."""
    try:
        temperature, scale = (float(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T/S (two numbers, e.g. 0.9/1.0), got {text!r}") from None
    if not (temperature > 0 and scale > 0):
        raise argparse.ArgumentTypeError(f"T and S must be > 0, got {text!r}")
    return temperature, scale


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_for("rag_accuracy", __doc__)
    parser.add_argument("--docs", type=int, default=20, help="documents in the store (at most 20 of 800 chars)")
    parser.add_argument("--facts-per-doc", type=int, default=1, help="facts planted in each document")
    parser.add_argument("--doc-chars", type=int, default=800, help="characters of real text per document")
    parser.add_argument(
        "--source-chars",
        type=int,
        default=None,
        help="take the texts that hold at least this many characters (default --doc-chars): fixed sources, so a "
        "sweep of --doc-chars changes only the length (8 texts hold 3200)",
    )
    parser.add_argument("--docs-per-query", type=int, default=3, help="documents in each prompt")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=6, help="greedy tokens generated per answer")
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument(
        "--methods", nargs="+", default=["selective", "cacheblend"], help=f"methods at every ratio: {METHOD_HELP}"
    )
    parser.add_argument("--realign-tokens", type=int, nargs="*", default=[], help="chunk-start realignment alone, K")
    parser.add_argument("--head-tokens", type=int, default=16, help="chunk-head tokens of the +heads methods")
    parser.add_argument("--filter-layers", type=int, default=4, help="layers of gradual filtering")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="only these configurations (names as in the table, e.g. none cacheblend@0.15; full prefill always runs)",
    )
    parser.add_argument(
        "--warm-after-header",
        action="store_true",
        help="warm each document after the system header (APE's shared prefix), not alone",
    )
    parser.add_argument(
        "--ape",
        type=temperature_and_scale,
        nargs="*",
        default=[],
        metavar="T/S",
        help="APE's attention temperature T and scaling factor S on the reused documents, e.g. 0.9/1.0",
    )
    parser.add_argument(
        "--ape-on",
        nargs="+",
        default=["none"],
        help="configurations (after --configs) the --ape pairs are added to (default: none)",
    )
    parser.add_argument(
        "--noise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also measure '{NOISE}' (the noise band of every measure)",
    )
    parser.add_argument(
        "--pair-with",
        default=DEFAULT_REPAIR,
        help="configuration every other is compared with per question (paired intervals; skipped if not run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    save_results(args.out, "rag_accuracy", run(args), report, plot)
    return 0
