"""``python -m kvboost_hf.bench multiturn``: TTFT per turn of a growing chat, three ways side by side.

An 8-turn conversation on the embedded SmolLM2-135M whose context grows past 1500 tokens (a reference document
as system prompt, each user turn quoting more documentation). For every turn, in rotating order:

(a) ``baseline``: plain ``model.generate()``, full prefill;
(b) ``hf_prompt_cache``: transformers' prompt-reuse recipe, a ``DynamicCache`` holding the previous turn's
    prompt, deep-copied per request (the copy is inside the timed region, as it is per request);
(c) ``kvboost``: ``engine.generate`` with a fresh ``ChunkReuseCache`` on the engine's chunk store.

TTFT runs from the call to the first generated token (streamer timestamp), tokenisation, lookup and stitching
included. The conversation continues with the baseline's answer, and the three answers are compared. The
conversation is played ``--repeats`` times from an empty store; each turn reports the median.
Writes ``multiturn.json`` and ``multiturn.png`` under ``--out``.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from kvboost_hf.bench.common import FirstTokenTimer, machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.shapes import SHAPES, random_engine
from kvboost_hf.corpus import chat_script
from kvboost_hf.engine import InferenceEngine

METHODS = ("baseline", "hf_prompt_cache", "kvboost")
TARGETS = {"turn8_vs_baseline_min": 8.0, "turn8_vs_hf_prompt_cache_max": 1.15, "turn1_vs_baseline_max": 1.05}


class PromptCacheRecipe:
    """Transformers' documented prompt reuse: keep the previous prompt's ``DynamicCache``, deep-copy per request."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.prompt_cache: DynamicCache | None = None
        self.prompt_ids: list[int] = []

    def generate(
        self, messages: list[dict[str, str]], max_new_tokens: int, reuse: bool = True
    ) -> tuple[float, list[int]]:
        """Returns (TTFT ms, generated ids); afterwards holds this prompt's K/V for the next turn. ``reuse=False``:
        plain ``model.generate()`` from an empty ``DynamicCache`` (full prefill), the held K/V unchanged."""
        started = time.perf_counter()
        ids = self.engine.encode(messages)
        usable = reuse and self.prompt_cache is not None and ids[: len(self.prompt_ids)] == self.prompt_ids
        cache = copy.deepcopy(self.prompt_cache) if usable and self.prompt_cache is not None else DynamicCache()
        timer = FirstTokenTimer()
        input_ids = torch.tensor([ids], device=self.engine.device)
        with torch.inference_mode():
            out = self.engine.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=cache,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                streamer=timer,
                pad_token_id=self.engine.tokenizer.eos_token_id,
            )
        ttft = ((timer.first_token_time or time.perf_counter()) - started) * 1e3
        generated = out[0, len(ids) :].tolist()
        if reuse:
            cache.crop(len(ids) - cache.get_seq_length())  # keep exactly this prompt's K/V (untimed bookkeeping)
            self.prompt_cache, self.prompt_ids = cache, ids
        return ttft, generated


def run(turns: int, max_new_tokens: int, chunk_size: int, repeats: int, random_shape: str | None = None) -> dict:
    """Play the conversation ``repeats`` times (each from an empty store) and keep each turn's median TTFT.

    ``random_shape``: a random-weight model of that shape (:mod:`kvboost_hf.bench.shapes`) instead of the embedded
    model; its answers are noise but its timings are those of the real shape."""
    if random_shape is None:
        engine = InferenceEngine.from_pretrained(chunking=chunk_size)
    else:
        engine = random_engine(random_shape, chunking=chunk_size)
    system, user_messages = chat_script(turns)
    engine.generate("warm-up", max_new_tokens=2, mode="baseline")  # first-call allocator effects, no reuse
    samples: list[list[dict]] = []
    for _ in tqdm(range(repeats), desc="repeats"):
        engine.store.clear()
        samples.append(play(engine, system, user_messages, max_new_tokens))
    rows = []
    for turn_samples in zip(*samples, strict=True):
        row = dict(turn_samples[0])
        for method in METHODS:
            row[f"{method}_ttft_ms"] = statistics.median(s[f"{method}_ttft_ms"] for s in turn_samples)
        row["outputs_identical"] = all(s["outputs_identical"] for s in turn_samples)
        rows.append(row)
    return {
        "benchmark": "multiturn",
        "machine": machine_info(engine.device),
        "model": engine.model.config._name_or_path,
        "chunk_size": chunk_size,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "targets": TARGETS,
        "turns": rows,
    }


def play(engine: InferenceEngine, system: str, user_messages: list[str], max_new_tokens: int) -> list[dict]:
    """One conversation; every turn runs the three methods in rotating order on the same messages."""
    recipe = PromptCacheRecipe(engine)
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn, text in enumerate(user_messages, start=1):
        messages.append({"role": "user", "content": text})
        results: dict[str, tuple[float, list[int]]] = {}
        for method in METHODS[turn % 3 :] + METHODS[: turn % 3]:
            if method != "kvboost":  # transformers' own generate(), from scratch or from the previous prompt
                results[method] = recipe.generate(messages, max_new_tokens, reuse=method == "hf_prompt_cache")
                continue
            r = engine.generate(messages, max_new_tokens=max_new_tokens)
            results[method] = (r.ttft_ms, r.output_ids)
            cached, prompt_tokens = r.cached_tokens, r.prompt_tokens
        answer = engine.tokenizer.decode(results["baseline"][1], skip_special_tokens=True)
        rows.append(
            {
                "turn": turn,
                "prompt_tokens": prompt_tokens,
                "kvboost_cached_tokens": cached,
                **{f"{m}_ttft_ms": results[m][0] for m in METHODS},
                "outputs_identical": len({tuple(results[m][1]) for m in METHODS}) == 1,
            }
        )
        messages.append({"role": "assistant", "content": answer})
    return rows


def report(result: dict) -> str:
    lines = [
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'baseline ms':>11} {'hf cache ms':>11} {'kvboost ms':>10} "
        f"{'vs base':>7} {'vs hf':>6} {'same':>5}"
    ]
    for row in result["turns"]:
        lines.append(
            f"{row['turn']:>4} {row['prompt_tokens']:>6} {row['kvboost_cached_tokens']:>6} "
            f"{row['baseline_ttft_ms']:>11.0f} {row['hf_prompt_cache_ttft_ms']:>11.0f} {row['kvboost_ttft_ms']:>10.0f} "
            f"{row['baseline_ttft_ms'] / row['kvboost_ttft_ms']:>6.1f}x "
            f"{row['kvboost_ttft_ms'] / row['hf_prompt_cache_ttft_ms']:>5.2f}x {row['outputs_identical']!s:>5}"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    turns = [row["turn"] for row in result["turns"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in METHODS:
        ax.plot(turns, [row[f"{method}_ttft_ms"] for row in result["turns"]], marker="o", label=method)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Multi-turn TTFT, {result['model'].split('/')[-1]}, {result['machine']['device']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = parser_for("multiturn", __doc__)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="conversations played; each turn keeps the median")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="random-weight model of this shape")
    args = parser.parse_args(argv)
    result = run(args.turns, args.max_new_tokens, args.chunk_size, args.repeats, args.random_shape)
    save_results(args.out, "multiturn", result, report, plot)
    return 0
