"""``python -m kvboost_hf.bench detokenize``: host work per generated token to turn a row's tokens into its text.

Two arms over the same answers (varied text with accents, CJK and emoji split over byte tokens, tokenized by the
embedded model's tokenizer, or ``--tokenizer``): ``whole`` decodes the whole answer and searches the stop strings in
the whole text at every token (the decode loop before issue 37); ``incremental`` is the rows' path now
(:class:`~kvboost_hf.hf.detokenize.IncrementalText`: a window of recent tokens, stop strings searched in the tail).
Per answer length it records the token ids decoded per token (mean and worst) and the microseconds per token over
the answer's last ``--tail`` tokens (where the whole arm's cost is largest). Both arms' final texts are checked
equal. Writes ``detokenize.json`` and ``detokenize.png`` under ``--out``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.hf.detokenize import IncrementalText, visible_text

STOPS = ("STOP!", "\n\n\n")  # never in the answers: every token searches


def answer_text(sentences: int) -> str:
    """Varied text: words, digits, punctuation, accents, CJK and emoji (characters split over byte tokens)."""
    sentence = "Le café n°{i} coûte {i}.50 € — naïve 日本語 😀🚀 {i}x{i}={sq}; ok?\n"
    return "".join(sentence.format(i=i, sq=i * i) for i in range(sentences))


class Counting:
    """A decode function that counts the token ids it is handed."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids = 0

    def __call__(self, ids: list[int]) -> str:
        self.ids += len(ids)
        return self.decode(ids)


class WholeArm:
    """The former path: the whole answer decoded, and the stop strings searched in it, at every token."""

    def __init__(self) -> None:
        self.text = ""

    def update(self, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.text = decode(list(tokens))
        visible_text(self.text, STOPS)

    def final(self) -> str:
        return self.text


class IncrementalArm(IncrementalText):
    """The rows' path: a window of recent tokens per token, stop strings searched in the tail."""

    def __init__(self) -> None:
        super().__init__(STOPS)

    def update(self, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        super().update(tokens, decode)
        self.visible(finished=False)

    def final(self) -> str:
        return self.visible(finished=True)


def measure(ids: list[int], decode: Callable[[list[int]], str], tail: int) -> dict[str, Any]:
    """Per arm: ids decoded per token (mean, worst) and microseconds per token over the last ``tail`` tokens;
    raises when the arms' final texts differ."""
    figures: dict[str, Any] = {}
    finals = []
    for name, arm in (("whole", WholeArm()), ("incremental", IncrementalArm())):
        counting = Counting(decode)
        per_token: list[int] = []
        seconds: list[float] = []
        for end in range(1, len(ids) + 1):
            before, started = counting.ids, time.perf_counter()
            arm.update(ids[:end], counting)
            seconds.append(time.perf_counter() - started)
            per_token.append(counting.ids - before)
        finals.append(arm.final())
        last = seconds[-tail:]
        figures[name] = {
            "ids_per_token_mean": sum(per_token) / len(per_token),
            "ids_per_token_worst": max(per_token),
            "us_per_token_tail": 1e6 * sum(last) / len(last),
        }
    if finals[0] != finals[1]:
        raise AssertionError("the incremental text differs from the whole decode")
    return figures


def report(result: dict[str, Any]) -> str:
    lines = ["tokens | ids/token whole (worst) | ids/token incremental (worst) | us/token whole | incremental | ratio"]
    for row in result["lengths"]:
        whole, inc = row["whole"], row["incremental"]
        lines.append(
            f"{row['tokens']:6d} | {whole['ids_per_token_mean']:10.1f} ({whole['ids_per_token_worst']:5d}) | "
            f"{inc['ids_per_token_mean']:10.2f} ({inc['ids_per_token_worst']:3d}) | "
            f"{whole['us_per_token_tail']:10.1f} | {inc['us_per_token_tail']:8.1f} | "
            f"{whole['us_per_token_tail'] / inc['us_per_token_tail']:6.1f}x"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    tokens = [row["tokens"] for row in result["lengths"]]
    for name in ("whole", "incremental"):
        axis.plot(tokens, [row[name]["us_per_token_tail"] for row in result["lengths"]], marker="o", label=name)
    axis.set_xlabel("answer length (tokens)")
    axis.set_ylabel("host µs per token (answer's last tokens)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str]) -> int:
    parser = parser_for("detokenize", __doc__)
    parser.add_argument("--lengths", default="50,500,2000", help="answer lengths in tokens, comma-separated")
    parser.add_argument("--tail", type=int, default=50, help="tokens at the end of each answer that are timed")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or name (default: the embedded model's)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from kvboost_hf.hf.models import embedded_model_dir

        args.tokenizer = str(embedded_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    lengths = [int(part) for part in args.lengths.split(",") if part]
    ids = tokenizer(answer_text(max(lengths)), add_special_tokens=False)["input_ids"]
    result = {
        "machine": machine_info("cpu"),
        "tokenizer": args.tokenizer,
        "lengths": [{"tokens": n, **measure(ids[:n], decode, min(args.tail, n))} for n in lengths],
    }
    save_results(args.out, "detokenize", result, report, plot)
    return 0
