"""``python -m kvboost_hf.bench rag``: fidelity and TTFT of non-prefix reuse on a RAG-style workload.

Documents (standard-library documentation shipped with Python, ~300-500 tokens each) are warmed once each with
``engine.warm``. Each query is a shuffled subset of them passed as segments, then a question. For every repair
strategy and recompute ratio, side by side with a full prefill in the same run, per query:

* TTFT (from the call to the first token: lookup, re-rotation, probe and repair included);
* first-token top-1 agreement with the full prefill, and KL(full prefill || reuse) of the first-token
  distribution;
* the length of the greedy prefix (of ``--new-tokens``) that matches the full prefill.

It also reports the share of prompt tokens found in the store by each chunking mode on the same shuffled
documents: fixed cuts over the plain concatenated string, segments, and content-defined cuts.
Writes ``rag.json`` and ``rag.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import RepairConfig
from kvboost_hf.corpus import documents
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.results import GenerationResult

STRATEGIES = ("none", "selective", "cacheblend")
RATIOS = (0.05, 0.15, 0.30, 1.0)
QUESTIONS = (
    "Which of the modules above would you use to read a CSV file, and why?",
    "Summarise what the first document is about in one sentence.",
    "Name two classes mentioned above.",
    "Which module deals with dates?",
    "What does the last document describe?",
    "Which of these modules helps with concurrency?",
)


def build_workload(num_docs: int, docs_per_query: int, queries: int, seed: int) -> tuple[list[str], list[list[str]]]:
    docs = [f"Document: {title}\n{text[:1700]}\n\n" for title, text in documents(min_chars=1200)[:num_docs]]
    rng = random.Random(seed)
    prompts = []
    for index in range(queries):
        chosen = rng.sample(docs, docs_per_query)
        prompts.append([*chosen, f"Question: {QUESTIONS[index % len(QUESTIONS)]}\nAnswer:"])
    return docs, prompts


def compare(result: GenerationResult, reference: GenerationResult) -> dict[str, float]:
    ref_logp = torch.log_softmax(reference.first_token_logits, -1)
    logp = torch.log_softmax(result.first_token_logits, -1)
    matched = 0
    for a, b in zip(result.output_ids, reference.output_ids, strict=False):
        if a != b:
            break
        matched += 1
    return {
        "ttft_ms": result.ttft_ms,
        "top1_agree": float(int(logp.argmax()) == int(ref_logp.argmax())),
        "kl": float((ref_logp.exp() * (ref_logp - logp)).sum()),
        "greedy_match": float(matched),
        "reused_tokens": float(result.cached_tokens),
        "recomputed_tokens": float(result.recomputed_tokens),
    }


def run(args: argparse.Namespace) -> dict:
    engine = InferenceEngine.from_pretrained(chunking=args.chunk_size)
    docs, prompts = build_workload(args.docs, args.docs_per_query, args.queries, args.seed)
    for doc in docs:
        engine.warm(doc)
    configs = [("none", 0.0)] + [(s, r) for s in STRATEGIES[1:] for r in RATIOS]
    per_config: dict[str, list[dict[str, float]]] = {f"{s}@{r}": [] for s, r in configs}
    baseline: list[dict[str, float]] = []
    engine.generate("warm-up", max_new_tokens=2, mode="baseline")
    for prompt in tqdm(prompts, desc="queries"):
        reference = engine.generate(prompt, max_new_tokens=args.new_tokens, mode="baseline", logprobs=0)
        baseline.append({"ttft_ms": reference.ttft_ms, "prompt_tokens": float(reference.prompt_tokens)})
        for strategy, ratio in configs:
            result = engine.generate(
                prompt,
                max_new_tokens=args.new_tokens,
                logprobs=0,
                repair=RepairConfig(strategy, ratio),
                cache_salt=None,
            )
            per_config[f"{strategy}@{ratio}"].append(compare(result, reference))
            engine.store.clear()  # every configuration starts from the warmed documents only
            for doc in docs:
                engine.warm(doc)
    summary = {
        name: {metric: statistics.fmean(row[metric] for row in rows) for metric in rows[0]}
        for name, rows in per_config.items()
    }
    full_ttft = statistics.fmean(row["ttft_ms"] for row in baseline)
    for row in summary.values():
        row["speedup_vs_full_prefill"] = full_ttft / row["ttft_ms"]
    return {
        "benchmark": "rag",
        "machine": machine_info(engine.device),
        "model": engine.model.config._name_or_path,
        "settings": vars(args) | {"out": str(args.out)},
        "full_prefill": {"ttft_ms": full_ttft, "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in baseline)},
        "configs": summary,
        "chunking_reuse": chunking_reuse(engine, docs, prompts),
    }


def chunking_reuse(engine: InferenceEngine, docs: list[str], prompts: list[list[str]]) -> dict[str, float]:
    """Share of prompt tokens found in the store (before repair) by each chunking mode."""
    shares = {}
    for name, chunking, as_segments in (
        ("fixed", "fixed", False),
        ("segments", "fixed", True),
        ("content", "content", False),
    ):
        config = ChunkingConfig(engine.chunking.chunk_size, method=chunking)
        probe = InferenceEngine(engine.model, engine.tokenizer, chunking=config)
        for doc in docs:
            probe.warm(doc)
        found = []
        for prompt in prompts:
            query = prompt if as_segments else "".join(prompt)
            result = probe.generate(query, max_new_tokens=1, repair=RepairConfig("none"))
            found.append((result.cached_tokens + result.recomputed_tokens) / result.prompt_tokens)
        shares[name] = statistics.fmean(found)
    return shares


def report(result: dict) -> str:
    full = result["full_prefill"]
    lines = [
        f"full prefill: {full['ttft_ms']:.0f} ms TTFT over {full['prompt_tokens']:.0f} prompt tokens",
        f"{'config':<16} {'TTFT ms':>8} {'speed-up':>8} {'top-1':>6} {'KL':>8} {'greedy match':>12} "
        f"{'reused':>7} {'recomputed':>10}",
    ]
    for name, row in result["configs"].items():
        lines.append(
            f"{name:<16} {row['ttft_ms']:>8.0f} {row['speedup_vs_full_prefill']:>7.2f}x "
            f"{row['top1_agree']:>6.0%} {row['kl']:>8.4f} {row['greedy_match']:>12.1f} "
            f"{row['reused_tokens']:>7.0f} {row['recomputed_tokens']:>10.0f}"
        )
    lines.append(
        "prompt tokens found in the store: " + ", ".join(f"{k} {v:.0%}" for k, v in result["chunking_reuse"].items())
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, (ax_kl, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    none = result["configs"]["none@0.0"]
    for strategy in STRATEGIES[1:]:
        rows = [result["configs"][f"{strategy}@{r}"] for r in RATIOS]
        ax_kl.plot(RATIOS, [r["kl"] for r in rows], marker="o", label=strategy)
        ax_ttft.plot(RATIOS, [r["ttft_ms"] for r in rows], marker="o", label=strategy)
    ax_kl.axhline(none["kl"], color="grey", linestyle="--", label="none")
    ax_ttft.axhline(none["ttft_ms"], color="grey", linestyle="--", label="none")
    ax_ttft.axhline(result["full_prefill"]["ttft_ms"], color="black", label="full prefill")
    ax_kl.set(xlabel="recompute ratio", ylabel="first-token KL vs full prefill", yscale="symlog")
    ax_ttft.set(xlabel="recompute ratio", ylabel="TTFT (ms)")
    for ax in (ax_kl, ax_ttft):
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"RAG reuse on {result['model'].split('/')[-1]} ({result['machine']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = parser_for("rag", __doc__)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--docs-per-query", type=int, default=3)
    parser.add_argument("--queries", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    save_results(args.out, "rag", run(args), report, plot)
    return 0
