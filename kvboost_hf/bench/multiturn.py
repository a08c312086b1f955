"""``python -m kvboost_hf.bench multiturn``: TTFT per turn of a growing chat, three ways side by side.

An 8-turn conversation on the embedded SmolLM2-135M whose context grows past 1500 tokens (a reference document
as system prompt, each user turn quoting more documentation). For every turn, in rotating order:

(a) ``baseline``: plain ``model.generate()``, full prefill;
(b) ``hf_prompt_cache``: transformers' prompt-reuse recipe, a ``DynamicCache`` holding the previous turn's
    prompt, deep-copied per request (the copy is inside the timed region, as it is per request);
(c) ``kvboost``: ``engine.generate`` with a fresh ``ChunkReuseCache`` on the engine's chunk store (on CUDA, or with
    ``--graphs on``, its decode steps and a warm turn's prompt forward of the new tokens after the reused K/V run as
    compiled graphs, CUDA graphs on a GPU: :mod:`kvboost_hf.hf.graphs`; ``pf`` says per turn whether that prompt
    forward ran graphed, ``g``, or eagerly, ``e``; with graphs on, one untimed conversation first compiles every
    shape the timed ones meet, its seconds ``graph_compile_pass_s``);
(d) ``hf_static``: plain ``model.generate()`` with transformers' ``StaticCache`` (prompt + new tokens long), which
    ``generate()`` compiles on CUDA by itself (its decode steps; the prefill runs eagerly): what a user who already
    runs transformers fast gets, full prefill every turn.

``total ms`` per method is the whole call (prompt to last token): where graphed decode shows. TTFT runs from the call
to the first generated token (streamer timestamp), tokenisation, lookup and stitching
included (the plain methods tokenize with the tokenizer itself; kvboost through the engine's token ids cache, whose
characters handed to the tokenizer each turn, ``tok ch``, are reported beside the prompt's). The conversation
continues with the baseline's answer. The conversation is played ``--repeats`` times from an empty store and token
cache; each turn reports the median. Python's garbage collections inside kvboost's timed requests are counted and
timed per request (``kvboost_gc``: by generation, a line of the report sums them). ``--profile-turn N`` replays
turn N's kvboost request twice more, by phase and under the profilers (the result's ``profile``).

Exactness is reported pairwise, per turn: the first generated token at which two methods' greedy outputs differ
(``=``: identical; the earliest over the repeats), for plain ``generate()`` against a second plain run (the noise
floor: in bf16 on a GPU the same computation is not always bitwise repeatable), against the recipe and against
kvboost, and kvboost against the recipe. In fp32 all four are expected identical; in bf16 kvboost is expected as
close to plain ``generate()`` as the recipe is (both reuse K/V computed in another call's shapes).

``--model DIR`` runs a local model instead of the embedded one, ``--random-shape NAME`` a random-weight model of a
real shape (timings only: its answers are noise); ``--dtype`` picks the weights' dtype (default float32 on CPU,
bfloat16 on GPU). Writes ``multiturn.json`` and ``multiturn.png`` under ``--out``.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from kvboost_hf.bench.common import (
    FirstTokenTimer,
    agreement_label,
    earliest_difference,
    first_difference,
    machine_info,
    parser_for,
    pyplot,
    save_results,
)
from kvboost_hf.bench.phases import phase_breakdown
from kvboost_hf.bench.profiling import CharacterCounter, GcTimer, profile_call, profile_report
from kvboost_hf.bench.shapes import DTYPES, SHAPES, random_engine
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.corpus import chat_script
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.results import GenerationResult

METHODS = ("baseline", "hf_prompt_cache", "kvboost", "hf_static")
REQUIRED_METHODS = ("baseline", "kvboost")
"""Always run: the reference and the product; ``--methods`` may leave out the others (``hf_static`` compiles a
CUDA graph per turn's cache length: ~30 s each for a 7B shape)."""
# Output pairs compared per turn: plain generate() run twice (the noise floor), then each reuse method against it.
PAIRS = (
    ("baseline", "baseline_repeat"),
    ("baseline", "hf_prompt_cache"),
    ("baseline", "kvboost"),
    ("hf_prompt_cache", "kvboost"),
    ("baseline", "hf_static"),
)
GRAPHS = {"auto": None, "on": True, "off": False}
"""``--graphs``: the engine's default (on CUDA only), or forced on (compiled graphs; traced eagerly off CUDA) or off."""
MAX_GRAPHS = 16
"""Graph shapes the conversation may meet: decode steps and prefills at each capacity bucket its turns reach."""
TARGETS = {"turn8_vs_baseline_min": 8.0, "turn8_vs_hf_prompt_cache_max": 1.15, "turn1_vs_baseline_max": 1.05}


class PromptCacheRecipe:
    """Transformers' documented prompt reuse: keep the previous prompt's ``DynamicCache``, deep-copy per request."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.prompt_cache: DynamicCache | None = None
        self.prompt_ids: list[int] = []

    def generate(
        self, messages: list[dict[str, str]], max_new_tokens: int, reuse: bool = True, static: bool = False
    ) -> tuple[float, list[int], float]:
        """Returns (TTFT ms, generated ids, total ms); afterwards holds this prompt's K/V for the next turn.
        ``reuse=False``: plain ``model.generate()`` from an empty cache (full prefill), the held K/V unchanged: a
        ``DynamicCache``, or with ``static`` a ``StaticCache`` of the prompt and new tokens (compiled decode on
        CUDA)."""
        started = time.perf_counter()
        tokenizer = self.engine.tokenizer  # transformers' own tokenization, not the engine's token ids cache
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        usable = reuse and self.prompt_cache is not None and ids[: len(self.prompt_ids)] == self.prompt_ids
        cache: DynamicCache | StaticCache
        if static:
            cache = StaticCache(config=self.engine.model.config, max_cache_len=len(ids) + max_new_tokens)
        else:
            cache = copy.deepcopy(self.prompt_cache) if usable and self.prompt_cache is not None else DynamicCache()
        timer = FirstTokenTimer()
        input_ids = torch.tensor([ids], device=self.engine.device)
        with torch.inference_mode():
            out = self.engine.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **{CACHE_ARGUMENT: cache},  # past_key_values before transformers 5.24
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                streamer=timer,
                pad_token_id=self.engine.tokenizer.eos_token_id,
            )
        finished = time.perf_counter()
        ttft = ((timer.first_token_time or finished) - started) * 1e3
        generated = out[0, len(ids) :].tolist()
        if reuse and isinstance(cache, DynamicCache):
            cache.crop(len(ids) - cache.get_seq_length())  # keep exactly this prompt's K/V (untimed bookkeeping)
            self.prompt_cache, self.prompt_ids = cache, ids
        return ttft, generated, (finished - started) * 1e3


LastTurn = Callable[[Callable[[], GenerationResult]], tuple[GenerationResult, dict[str, Any]]]
"""Runs kvboost's request at a conversation's last turn (the call given) and returns its result and figures."""


def _by_phase(engine: InferenceEngine) -> LastTurn:
    """A :data:`LastTurn` that times the request by phase: figures ``{"phases": ms per phase}``."""

    def measure(call: Callable[[], GenerationResult]) -> tuple[GenerationResult, dict[str, Any]]:
        def request() -> tuple[float, GenerationResult]:
            result = call()
            return result.ttft_ms, result

        result, phases = phase_breakdown(engine, request)
        return result, {"phases": phases}

    return measure


def pair_name(first: str, second: str) -> str:
    return f"{first}_vs_{second}"


def run(
    turns: int,
    max_new_tokens: int,
    chunk_size: int,
    repeats: int,
    random_shape: str | None = None,
    model: str | None = None,
    dtype: str | None = None,
    graphs: bool | None = None,
    methods: tuple[str, ...] = METHODS,
    profile_turn: int | None = None,
) -> dict:
    """Play the conversation ``repeats`` times (each from an empty store) and keep each turn's median TTFT and
    earliest difference per pair.

    ``random_shape``: a random-weight model of that shape (:mod:`kvboost_hf.bench.shapes`) instead of ``model`` (a
    hub name or local directory; None: the embedded model); its answers are noise but its timings are those of the
    real shape. ``dtype``: the weights' dtype (None: float32 on CPU, bfloat16 on GPU). ``graphs``: the kvboost
    method's compiled graphs (:data:`GRAPHS`; None: the engine's default); when on, an untimed conversation first
    compiles the shapes the timed ones meet. ``methods``: the methods run (in :data:`METHODS` order; must include
    :data:`REQUIRED_METHODS`); a pair with a method left out is not compared. ``profile_turn``: afterwards, the
    conversation twice more up to that turn (baseline and kvboost, from an empty store), kvboost's request at that
    turn for one token timed by phase (:func:`~kvboost_hf.bench.phases.phase_breakdown`), then under the profilers
    (:func:`~kvboost_hf.bench.profiling.profile_call`): the result's ``profile``."""
    methods = checked_methods(methods)
    options: dict[str, Any] = {} if graphs is None else {"graphs": GraphConfig(enabled=graphs, max_graphs=MAX_GRAPHS)}
    if random_shape is None:
        engine = InferenceEngine.from_pretrained(model, dtype=dtype, chunking=chunk_size, **options)
    else:
        engine = random_engine(random_shape, dtype=dtype, chunking=chunk_size, **options)
    system, user_messages = chat_script(turns)
    engine.generate("warm-up", max_new_tokens=2, mode="baseline")  # first-call allocator effects, no reuse
    compile_pass_s = None
    if engine.graphs.state != "off":
        started = time.perf_counter()
        play(engine, system, user_messages, max_new_tokens, methods)  # compiles, untimed: no timed turn pays one
        compile_pass_s = time.perf_counter() - started
    samples: list[list[dict]] = []
    for _ in tqdm(range(repeats), desc="repeats"):
        engine.store.clear()
        engine.tokens.clear()
        samples.append(play(engine, system, user_messages, max_new_tokens, methods))
    rows = []
    for turn_samples in zip(*samples, strict=True):
        row = dict(turn_samples[0])
        for method in methods:
            for figure in ("ttft_ms", "total_ms"):
                row[f"{method}_{figure}"] = statistics.median(s[f"{method}_{figure}"] for s in turn_samples)
        row["first_difference"] = {
            pair: earliest_difference([s["first_difference"][pair] for s in turn_samples])
            for pair in row["first_difference"]
        }
        row["outputs_identical"] = all(s["outputs_identical"] for s in turn_samples)
        row["kvboost_prefill_graphed"] = all(s["kvboost_prefill_graphed"] for s in turn_samples)
        row["kvboost_gc"] = [s["kvboost_gc"] for s in turn_samples]  # per repeat
        rows.append(row)
    identical = {pair: sum(r["first_difference"][pair] is None for r in rows) for pair in rows[0]["first_difference"]}
    profile = None
    if profile_turn is not None:
        engine.store.clear()
        engine.tokens.clear()
        profile = {"turn": profile_turn}
        for measure in (_by_phase(engine), functools.partial(profile_call, device=engine.device)):
            engine.store.clear()
            engine.tokens.clear()
            replayed = play(engine, system, user_messages[:profile_turn], max_new_tokens, REQUIRED_METHODS, measure)
            profile |= replayed[-1]["kvboost_profile"]
    return {
        "benchmark": "multiturn",
        "machine": machine_info(engine.device),
        "model": engine.model.config._name_or_path,
        "weights": "random" if random_shape is not None else "trained",
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "chunk_size": chunk_size,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "targets": TARGETS,
        "methods": list(methods),
        "graphs": engine.graphs.state,
        "graph_compile_pass_s": compile_pass_s,
        "graph_stats": engine.graphs.stats(),
        "identical_turns": identical,
        "turns": rows,
        "profile": profile,
    }


def checked_methods(methods: tuple[str, ...]) -> tuple[str, ...]:
    """``methods`` in :data:`METHODS` order; a ``ValueError`` names an unknown or missing required one."""
    unknown = sorted(set(methods) - set(METHODS))
    missing = [method for method in REQUIRED_METHODS if method not in methods]
    if unknown or missing:
        raise ValueError(
            f"methods must be among {METHODS} and include {REQUIRED_METHODS}: unknown {unknown}, missing {missing}"
        )
    return tuple(method for method in METHODS if method in methods)


def play(
    engine: InferenceEngine,
    system: str,
    user_messages: list[str],
    max_new_tokens: int,
    methods: tuple[str, ...] = METHODS,
    last_turn: LastTurn | None = None,
) -> list[dict]:
    """One conversation; every turn runs ``methods`` in rotating order on the same messages, then plain
    ``generate()`` once more (untimed use: the noise floor of the output comparison). ``last_turn``: kvboost's
    request at the last turn runs for one token through it (its row's ``kvboost_profile``: the TTFT and the
    figures it returned)."""
    recipe = PromptCacheRecipe(engine)
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn, text in enumerate(user_messages, start=1):
        messages.append({"role": "user", "content": text})
        results: dict[str, tuple[float, list[int], float]] = {}
        rotation = turn % len(methods)
        for method in methods[rotation:] + methods[:rotation]:
            if method != "kvboost":  # transformers' own generate(), from scratch or from the previous prompt
                reuse, static = method == "hf_prompt_cache", method == "hf_static"
                results[method] = recipe.generate(messages, max_new_tokens, reuse=reuse, static=static)
                continue
            graphed_before = engine.graphs.graphed_prefills
            profiled = last_turn is not None and turn == len(user_messages)
            with CharacterCounter(engine.tokenizer) as counter, GcTimer() as collector:
                if last_turn is not None and profiled:
                    r, figures = last_turn(functools.partial(engine.generate, messages, max_new_tokens=1))
                else:
                    r = engine.generate(messages, max_new_tokens=max_new_tokens)
            tokenized, prefill_graphed = counter.chars, engine.graphs.graphed_prefills > graphed_before
            collections = collector.as_dict()
            results[method] = (r.ttft_ms, r.output_ids, r.total_ms)
            cached, prompt_tokens = r.cached_tokens, r.prompt_tokens
        results["baseline_repeat"] = recipe.generate(messages, max_new_tokens, reuse=False)
        answer = engine.tokenizer.decode(results["baseline"][1], skip_special_tokens=True)
        differences = {
            pair_name(a, b): first_difference(results[a][1], results[b][1])
            for a, b in PAIRS
            if a in results and b in results
        }
        rows.append(
            {
                "turn": turn,
                "prompt_tokens": prompt_tokens,
                "kvboost_cached_tokens": cached,
                "prompt_chars": len(engine.render(messages)),
                "kvboost_chars_tokenized": tokenized,
                "kvboost_prefill_graphed": prefill_graphed,
                "kvboost_gc": collections,
                **{f"{m}_ttft_ms": results[m][0] for m in methods},
                **{f"{m}_total_ms": results[m][2] for m in methods},
                "first_difference": differences,
                "outputs_identical": all(index is None for index in differences.values()),
                **({"kvboost_profile": {"ttft_ms": r.ttft_ms, **figures}} if profiled else {}),
            }
        )
        messages.append({"role": "assistant", "content": answer})
    return rows


def report(result: dict) -> str:
    """TTFT per turn and, per pair, where the outputs first differ (``=``: identical; ``-``: a method not run)."""
    header = ("plain/plain", "hf/plain", "kv/plain", "kv/hf", "static/plain")

    def ms(row: dict, method: str) -> str:
        value = row.get(f"{method}_ttft_ms")
        return "-" if value is None else f"{value:.0f}"

    def agreement(row: dict, pair: tuple[str, str]) -> str:
        name = pair_name(*pair)
        return agreement_label(row["first_difference"][name]) if name in row["first_difference"] else "-"

    lines = [
        f"{result['model']} ({result['weights']} weights, {result['dtype']}); first differing generated token per "
        "pair (=: identical; plain/plain is plain generate() run twice, the noise floor; -: not run)",
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'chars':>6} {'tok ch':>6} {'pf':>2} "
        f"{'baseline ms':>11} {'hf cache ms':>11} {'kvboost ms':>10} {'static ms':>9} "
        f"{'vs base':>7} {'vs hf':>6} " + " ".join(f"{name:>11}" for name in header),
    ]
    for row in result["turns"]:
        recipe = row.get("hf_prompt_cache_ttft_ms")
        lines.append(
            f"{row['turn']:>4} {row['prompt_tokens']:>6} {row['kvboost_cached_tokens']:>6} "
            f"{row['prompt_chars']:>6} {row['kvboost_chars_tokenized']:>6} "
            f"{'g' if row['kvboost_prefill_graphed'] else 'e':>2} "
            f"{ms(row, 'baseline'):>11} {ms(row, 'hf_prompt_cache'):>11} {ms(row, 'kvboost'):>10} "
            f"{ms(row, 'hf_static'):>9} "
            f"{row['baseline_ttft_ms'] / row['kvboost_ttft_ms']:>6.1f}x "
            + (f"{row['kvboost_ttft_ms'] / recipe:>5.2f}x " if recipe is not None else f"{'-':>6} ")
            + " ".join(f"{agreement(row, p):>11}" for p in PAIRS)
        )
    counts = ", ".join(
        f"{name} {result['identical_turns'][pair_name(*p)]}"
        for name, p in zip(header, PAIRS, strict=True)
        if pair_name(*p) in result["identical_turns"]
    )
    lines.append(f"turns identical (of {len(result['turns'])}): {counts}")
    last = result["turns"][-1]
    lines.append(
        "last turn, whole call (prompt to last token): "
        + ", ".join(f"{method} {last[f'{method}_total_ms']:.0f} ms" for method in result["methods"])
    )
    collected = [sample for row in result["turns"] for sample in row.get("kvboost_gc", [])]
    if collected:
        per_request = [sum(sample["ms"]) for sample in collected]
        lines.append(
            f"garbage collections inside kvboost's requests: {sum(sum(s['collections']) for s in collected)} "
            f"({sum(s['collections'][2] for s in collected)} full), {sum(per_request):.1f} ms in all, at most "
            f"{max(per_request):.1f} ms in one request"
        )
    if result.get("profile"):
        profile = result["profile"]
        phases = ", ".join(f"{name} {ms:.1f}" for name, ms in profile["phases"].items())
        lines.append(f"kvboost at turn {profile['turn']}, one token, by phase (ms): {phases}")
        lines.append(f"the same request under the profilers (TTFT {profile['ttft_ms']:.1f} ms):")
        lines.append(profile_report(profile, "call"))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    turns = [row["turn"] for row in result["turns"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in result["methods"]:
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
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    parser.add_argument("--repeats", type=int, default=3, help="conversations played; each turn keeps the median")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="hub name or local model directory (default: the embedded model)")
    model.add_argument("--random-shape", choices=sorted(SHAPES), help="random-weight model of this shape")
    parser.add_argument("--dtype", choices=DTYPES, help="weights' dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument(
        "--graphs", choices=sorted(GRAPHS), default="auto", help="kvboost's compiled graphs (auto: on CUDA only)"
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma list of the methods run, among {','.join(METHODS)} (baseline and kvboost always)",
    )
    parser.add_argument(
        "--profile-turn",
        type=int,
        help="afterwards, profile kvboost's request at this turn (torch.profiler and cProfile): where its time goes",
    )
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    if args.profile_turn is not None and not 1 <= args.profile_turn <= args.turns:
        parser.error(f"--profile-turn must be between 1 and --turns ({args.turns}), got {args.profile_turn}")
    try:
        methods = checked_methods(tuple(name.strip() for name in args.methods.split(",") if name.strip()))
    except ValueError as error:
        parser.error(f"--methods: {error}")
    result = run(
        args.turns,
        args.max_new_tokens,
        args.chunk_size,
        args.repeats,
        args.random_shape,
        args.model,
        args.dtype,
        GRAPHS[args.graphs],
        methods,
        args.profile_turn,
    )
    save_results(args.out, "multiturn", result, report, plot)
    return 0
