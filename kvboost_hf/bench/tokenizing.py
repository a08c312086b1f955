"""``python -m kvboost_hf.bench tokenizing``: what tokenizing costs a growing chat's requests, with and without the
engine's token ids cache (:mod:`kvboost_hf.hf.tokens`), side by side.

The multiturn benchmark's conversation (:func:`~kvboost_hf.corpus.chat_script`: a long system prompt, ``--turns``
user messages; each answer its turn's number and a fixed text of ``--answer-chars`` characters, since no model runs
here: only the tokenizer of ``--model``, default the embedded one). Every turn's request encodes the rendered chat
once, as ``engine.encode`` does, two ways:

* ``whole``: the cache off (``TokenCacheConfig(max_bytes=0)``): the whole prompt handed to the tokenizer;
* ``cached``: a :class:`~kvboost_hf.hf.tokens.SegmentTokenizer` whose cache holds the earlier turns' pieces.

Per turn: the prompt's characters, the new messages' characters (the last answer and the new question), the
characters each way hands to the tokenizer's backend (:class:`~kvboost_hf.bench.profiling.CharacterCounter`) and
the median ms over ``--repeats`` conversations (each from an empty cache). Both ways' ids are checked equal to the
tokenizer's own. Target (issue 37): a warm request tokenizes at most the new messages' characters plus one segment.

Then a long document as a plain string prompt (``--document-tokens``, default 32,768: the long-context benchmark's
largest, :func:`~kvboost_hf.corpus.numbered_document`) followed by ``--questions`` different questions, the
long-context benchmark's prompts: the first is cold, each later one continues the cached document's ids (the cache
keeps them up to the document's last line and tokenizes the rest). The same figures per question.
Writes ``tokenizing.json`` and ``tokenizing.png`` under ``--out``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.profiling import CharacterCounter
from kvboost_hf.corpus import chat_script, document_question, numbered_document
from kvboost_hf.hf.models import embedded_model_dir
from kvboost_hf.hf.tokens import SegmentTokenizer, TokenCacheConfig, TokenIdsCache

WAYS = ("whole", "cached")


def fresh_ways(tokenizer: PreTrainedTokenizerBase) -> dict[str, SegmentTokenizer]:
    """Each way's tokenizer, from an empty cache."""
    return {
        "whole": SegmentTokenizer(tokenizer, TokenIdsCache(0)),
        "cached": SegmentTokenizer(tokenizer, TokenIdsCache(TokenCacheConfig().max_bytes)),
    }


def encode_each_way(
    tokens: dict[str, SegmentTokenizer], text: str, label: str, row: dict[str, int | float]
) -> dict[str, int | float]:
    """``row`` with ``text``'s characters and tokens and each way's ms and characters tokenized; raises when a way's
    ids differ from the tokenizer's own (``label`` names the request)."""
    tokenizer = tokens["whole"].tokenizer
    expected = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    row.update(prompt_chars=len(text), prompt_tokens=len(expected))
    for way in WAYS:
        with CharacterCounter(tokenizer) as counter:
            started = time.perf_counter()
            ids = tokens[way].encode(text)
            row[f"{way}_ms"] = (time.perf_counter() - started) * 1e3
        if ids != expected:
            raise AssertionError(f"{label}: the {way} ids differ from the tokenizer's own")
        row[f"{way}_chars"] = counter.chars
    return row


def play(
    tokenizer: PreTrainedTokenizerBase, system: str, questions: list[str], answer: str
) -> list[dict[str, int | float]]:
    """One conversation from empty caches: per turn, characters and ms of each way's encode of the prompt."""
    tokens = fresh_ways(tokenizer)
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn, question in enumerate(questions, start=1):
        new = [{"role": "assistant", "content": f"{turn - 1}. {answer}"}] if turn > 1 else []
        new.append({"role": "user", "content": question})
        messages += new
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        row: dict[str, int | float] = {"turn": turn, "new_message_chars": sum(len(m["content"]) for m in new)}
        rows.append(encode_each_way(tokens, text, f"turn {turn}", row))
    return rows


def play_document(tokenizer: PreTrainedTokenizerBase, document: str, questions: int) -> list[dict[str, int | float]]:
    """A document asked ``questions`` questions from empty caches: per question, each way's encode of the plain
    string prompt (document and question)."""
    tokens = fresh_ways(tokenizer)
    rows = []
    for index in range(1, questions + 1):
        question = document_question(index)
        row: dict[str, int | float] = {"turn": index, "new_message_chars": len(question)}
        rows.append(encode_each_way(tokens, document + question, f"question {index}", row))
    return rows


def medians(samples: list[list[dict[str, int | float]]]) -> list[dict[str, int | float]]:
    """Per request, the first sample's figures with each way's median ms over all samples."""
    rows = []
    for request_samples in zip(*samples, strict=True):
        row = dict(request_samples[0])
        for way in WAYS:
            row[f"{way}_ms"] = statistics.median(sample[f"{way}_ms"] for sample in request_samples)
        rows.append(row)
    return rows


def run(
    turns: int,
    repeats: int,
    system_chars: int,
    message_chars: int,
    answer_chars: int,
    model: str | None,
    document_tokens: int = 32_768,
    questions: int = 4,
) -> dict:
    """Play the conversation, then the document's questions, ``repeats`` times each; every request keeps the
    median ms (characters are the same each time)."""
    tokenizer = AutoTokenizer.from_pretrained(model or embedded_model_dir())
    system, chat_questions = chat_script(turns, system_chars=system_chars, message_chars=message_chars)
    answer = ("The answer, in one sentence: it does what its name says. " * (answer_chars // 56 + 1))[:answer_chars]
    rows = medians([play(tokenizer, system, chat_questions, answer) for _ in range(repeats)])
    document = numbered_document(tokenizer, document_tokens) if questions else ""
    asked = medians([play_document(tokenizer, document, questions) for _ in range(repeats)]) if questions else []
    probe = SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20))
    return {
        "benchmark": "tokenizing",
        "machine": machine_info("cpu"),
        "tokenizer": str(model or "embedded SmolLM2-135M-Instruct"),
        "segmented": probe.segmented,
        "continues": probe.continues,
        "repeats": repeats,
        "turns": rows,
        "warm_chars_over_new_chars_max": max(
            (r["cached_chars"] / max(r["new_message_chars"], 1) for r in rows[1:]), default=0
        ),
        "document_questions": asked,
    }


def _table(rows: list[dict], label: str) -> list[str]:
    lines = [
        f"{label:>8} {'prompt ch':>9} {'tokens':>6} {'new ch':>6} {'whole ch':>8} {'cached ch':>9} "
        f"{'whole ms':>8} {'cached ms':>9} {'speed-up':>8}"
    ]
    for row in rows:
        lines.append(
            f"{row['turn']:>8} {row['prompt_chars']:>9} {row['prompt_tokens']:>6} {row['new_message_chars']:>6} "
            f"{row['whole_chars']:>8} {row['cached_chars']:>9} {row['whole_ms']:>8.2f} {row['cached_ms']:>9.2f} "
            f"{row['whole_ms'] / max(row['cached_ms'], 1e-6):>7.1f}x"
        )
    return lines


def report(result: dict) -> str:
    lines = [
        f"tokenizer {result['tokenizer']} (pieces cached: {result['segmented']}, pieces continued: "
        f"{result['continues']}); characters handed to the tokenizer and ms per request (median of "
        f"{result['repeats']})",
        *_table(result["turns"], "turn"),
        "warm requests: characters tokenized / new messages' characters <= "
        f"{result['warm_chars_over_new_chars_max']:.3f} (the role lines of the new messages are the rest)",
    ]
    if result["document_questions"]:
        lines += [
            "a document as a plain string prompt, then another question each time (the first is cold)",
            *_table(result["document_questions"], "question"),
        ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    parts = [("growing chat, turn", result["turns"]), ("document, question", result["document_questions"])]
    parts = [(label, rows) for label, rows in parts if rows]
    fig, axes = plt.subplots(len(parts), 2, figsize=(10, 4 * len(parts)), squeeze=False)
    for (label, rows), (chars, ms) in zip(parts, axes, strict=True):
        requests = [row["turn"] for row in rows]
        for way in WAYS:
            chars.plot(requests, [row[f"{way}_chars"] for row in rows], marker="o", label=way)
            ms.plot(requests, [row[f"{way}_ms"] for row in rows], marker="o", label=way)
        chars.set_ylabel("characters tokenized")
        ms.set_ylabel("ms per request")
        for ax in (chars, ms):
            ax.set_xlabel(label)
            ax.legend()
            ax.grid(True, alpha=0.3)
    fig.suptitle(f"Tokenizing, {result['tokenizer']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = parser_for("tokenizing", __doc__)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="conversations played; each turn keeps the median")
    parser.add_argument("--system-chars", type=int, default=4000, help="characters of the system prompt")
    parser.add_argument("--message-chars", type=int, default=220, help="documentation quoted per user message")
    parser.add_argument("--answer-chars", type=int, default=160, help="characters of each (fixed) answer")
    parser.add_argument("--model", help="hub name or local directory whose tokenizer is used (default: embedded)")
    parser.add_argument("--document-tokens", type=int, default=32_768, help="tokens of the long document")
    parser.add_argument("--questions", type=int, default=4, help="questions on the document (0: no document)")
    args = parser.parse_args(argv)
    result = run(
        args.turns, args.repeats, args.system_chars, args.message_chars, args.answer_chars, args.model,
        args.document_tokens, args.questions,
    )  # fmt: skip
    save_results(args.out, "tokenizing", result, report, plot)
    return 0
