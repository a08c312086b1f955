"""``python -m kvboost_hf.bench rag_server``: RAG requests through the server, documents sent as content parts.

One server process (``--reuse-mode chunk_kv_reuse``; repair from ``--recompute-strategy``/``--recompute-ratio``) answers
``--queries`` questions, each over 3 of ``--documents`` corpus documents (real text, :mod:`kvboost_hf.corpus`) in
a shuffled order, sent as text parts of one user message after a system prompt, the question as the last part.
Each query is sent three ways, side by side (interleaved, so machine load hits all three alike):

* ``cold``: a fresh ``cache_salt`` per request: a full prefill, the reference answer;
* ``plain``: ``document_boundaries: "none"``: the prompt chunked as one text (what the server did before);
* ``parts``: ``document_boundaries: "parts"``: each document starts a segment and hits by content key.

Before the timed queries the ``plain`` and ``parts`` tenants each see every document once (priming requests of
three documents in corpus order), so their reuse comes from documents seen in other orders and positions.
Measured per request with the official ``openai`` client (streaming): TTFT (ms), cached prompt tokens, and whether
the greedy answer equals ``cold``'s. Output: a table, ``rag_server.json`` and ``rag_server.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvboost_hf.bench.common import pyplot
from kvboost_hf.bench.serve import MODEL, ServerProcess, percentile
from kvboost_hf.corpus import documents

logger = logging.getLogger(__name__)
WAYS = {"cold": None, "plain": "none", "parts": "parts"}  # way -> document_boundaries sent
SYSTEM = "Answer the question from the documents, in one sentence."
DOCUMENTS_PER_QUERY = 3


@dataclass
class Record:
    """One request as the client saw it."""

    query: int
    way: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


def document_texts(count: int, max_chars: int) -> list[str]:
    """``count`` corpus documents, each cut to ``max_chars`` characters and ended with one newline."""
    corpus = documents()
    if count > len(corpus):
        raise ValueError(f"the corpus holds {len(corpus)} documents, {count} asked")
    return [f"{title}\n{body[:max_chars].rstrip()}\n" for title, body in corpus[:count]]


def messages(docs: list[str], question: str) -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": text} for text in [*docs, question]]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def send(client: Any, query: int, way: str, docs: list[str], question: str, salt: str, max_tokens: int) -> Record:
    """One streamed greedy request; TTFT is the time to its first content chunk."""
    extra: dict[str, Any] = {"cache_salt": salt}
    if WAYS[way] is not None:
        extra["document_boundaries"] = WAYS[way]
    started = time.perf_counter()
    ttft, answer, usage = None, "", None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(docs, question),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else (time.perf_counter() - started) * 1e3
            answer += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    if usage is None or ttft is None:
        raise RuntimeError(f"query {query} ({way}): the stream ended without content or usage")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Record(query, way, ttft, usage.prompt_tokens, cached or 0, answer)


def run(args: argparse.Namespace) -> list[Record]:
    """Start the server, prime the reuse tenants, run every query three ways; returns the timed records."""
    import openai

    docs = document_texts(args.documents, args.document_chars)
    rng = random.Random(args.seed)
    flags = ["--reuse-mode", "chunk_kv_reuse", "--chunk-size", str(args.chunk_size), "--threads", str(args.threads)]
    flags += ["--recompute-strategy", args.recompute_strategy, "--recompute-ratio", str(args.recompute_ratio)]
    server = ServerProcess(flags, args.startup_timeout_s)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        question = "Which of these modules would you use to solve a practical task, and why?"
        for first in range(0, len(docs), DOCUMENTS_PER_QUERY):
            for way in ("plain", "parts"):
                send(client, -1, way, docs[first : first + DOCUMENTS_PER_QUERY], question, way, args.max_tokens)
        records = []
        for query in range(args.queries):
            chosen = rng.sample(docs, DOCUMENTS_PER_QUERY)
            asked = f"Question {query}: what does the second document describe?"
            for way in WAYS:
                salt = f"cold-{uuid.uuid4().hex}" if way == "cold" else way
                records.append(send(client, query, way, chosen, asked, salt, args.max_tokens))
        return records
    finally:
        server.stop()


def summarize(records: list[Record]) -> dict[str, dict[str, float]]:
    """Per way: TTFT p50 (ms), speed-up of p50 over cold, share of prompt tokens cached, answers equal to cold's."""
    cold = {r.query: r for r in records if r.way == "cold"}
    summary = {}
    for way in WAYS:
        mine = [r for r in records if r.way == way]
        ttft = percentile([r.ttft_ms for r in mine], 50)
        summary[way] = {
            "ttft_p50_ms": ttft,
            "speedup_vs_cold": percentile([cold[r.query].ttft_ms for r in mine], 50) / ttft,
            "cached_share": sum(r.cached_tokens for r in mine) / sum(r.prompt_tokens for r in mine),
            "answers_equal_cold": sum(r.answer == cold[r.query].answer for r in mine) / len(mine),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in mine) / len(mine),
        }
    return summary


def plot(summary: dict[str, dict[str, float]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = [("TTFT p50 (ms)", "ttft_p50_ms"), ("prompt tokens cached", "cached_share"),
              ("answers equal to cold", "answers_equal_cold")]  # fmt: skip
    for ax, (label, key) in zip(axes, panels, strict=True):
        ax.bar(list(summary), [summary[way][key] for way in summary], color=["0.6", "tab:orange", "tab:blue"])
        ax.set_title(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench rag_server", description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=12)
    parser.add_argument("--documents", type=int, default=9, help="corpus documents the queries draw from")
    parser.add_argument("--document-chars", type=int, default=1200, help="each document cut to this many characters")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--recompute-strategy", default="selective", choices=("none", "selective", "cacheblend"))
    parser.add_argument("--recompute-ratio", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    if not (1 <= args.queries <= 100 and args.documents >= DOCUMENTS_PER_QUERY and 1 <= args.max_tokens <= 256):
        parser.error("keep the load bounded: 1-100 queries, at least 3 documents, max-tokens <= 256")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    records = run(args)
    summary = summarize(records)
    print(f"{'way':<7}{'TTFT p50':>10}{'vs cold':>9}{'cached':>8}{'= cold':>8}{'prompt':>8}")
    for way, s in summary.items():
        print(
            f"{way:<7}{s['ttft_p50_ms']:>10.0f}{s['speedup_vs_cold']:>8.2f}x{s['cached_share']:>8.2f}"
            f"{s['answers_equal_cold']:>8.2f}{s['mean_prompt_tokens']:>8.0f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "cpu_count": os.cpu_count(), "summary": summary,
               "records": [asdict(r) for r in records]}  # fmt: skip
    (args.out / "rag_server.json").write_text(json.dumps(payload, indent=2))
    repair = f"{args.recompute_strategy}@{args.recompute_ratio:g}"
    plot(summary, args.out / "rag_server.png", f"RAG over the server: documents as content parts ({repair})")
    print(f"wrote {args.out / 'rag_server.json'} and {args.out / 'rag_server.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
