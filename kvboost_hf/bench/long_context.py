"""``python -m kvboost_hf.bench long_context``: a long shared document, then questions on it, against its limit.

For each document length (``--sizes``, tokens), a prompt is the document followed by a short question. Measured
side by side in one run (TTFT = from the text prompt to the first generated token on the host, tokenizing
included, best of ``--repeats`` distinct questions):

* ``full``: plain ``model.generate()`` (full prefill);
* ``cold``: the engine with an empty store (it computes and writes back the document; best of two);
* ``warm_<tier>``: another question on the same document, its K/V loaded from ``ram`` (the CPU RAM tier,
  page-locked on a GPU machine) or ``gpu`` (the GPU tier; GPU machines only), best of ``--repeats`` after a first
  warm request, reported apart as ``warm_<tier>_first_ms`` (with graphs on, a new prompt shape's compile or CUDA
  graph record lands in it: an H200 run measured its 32k GPU-tier request at 37 ms once steady, where the best of
  the first two was 62 ms);
* ``limit_<tier>``: what the warm request cannot go below, measured in the same run: tokenizing the prompt as a
  warm request does (the engine's token ids cache continues the document's cached ids and tokenizes its last line
  and the question, :mod:`kvboost_hf.hf.tokens`) +
  the reused K/V bytes over the tier's measured copy bandwidth (pinned host-to-device, or device-to-device; on a
  CPU, a host memory copy) + a bare forward of only the new tokens over a prebuilt cache.

Also per tier: a breakdown of one warm request (tokenize, keys, lookup, plan, copy into the cache, forward,
write-back, and the rest; CUDA events on a GPU, wall clock on a CPU) and the bytes it copied against the reused
K/V bytes (:class:`~kvboost_hf.bench.profiling.CopyCounter`, in a separate untimed run).

Writes ``long_context.json`` and ``long_context.png`` under ``--out``.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import Cache

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.phases import phase_breakdown
from kvboost_hf.bench.profiling import CopyCounter, timed_call
from kvboost_hf.bench.shapes import SHAPES, random_engine
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.corpus import document_question, numbered_document
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.layers import ChunkReuseLayer
from kvboost_hf.hf.models import CACHE_ARGUMENT, kv_entry_shape, model_dtype
from kvboost_hf.store.chunk_store import ChunkStore, StoreConfig

DEFAULT_SIZES = (4096, 16384, 32000)
STORE_BYTES = 8 << 30  # every tier holds the longest document (1.84 GB on the 7B shape at 32k tokens)
TARGETS = {"warm_within_limit_max": 1.5, "gpu_32k_speedup_min": 15.0, "ram_32k_speedup_min": 10.0}


def ttft_ms(engine: InferenceEngine, prompt: str, **options: Any) -> tuple[float, Any]:
    """(ms from the text prompt to the first generated token on the host, the result)."""
    arrivals: list[float] = []
    started = time.perf_counter()
    result = engine.generate(prompt, max_new_tokens=2, on_token=lambda _: arrivals.append(time.perf_counter()))
    return (arrivals[0] - started) * 1e3, result


def full_prefill_ms(engine: InferenceEngine, prompt: str) -> float:
    """Plain ``model.generate()`` of one token, tokenizing included (with the tokenizer itself, not the engine's
    token ids cache, which this would fill for the warm requests)."""

    def run() -> None:
        ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]], device=engine.device)
        with torch.inference_mode():
            engine.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                pad_token_id=engine.prompts.pad_token_id,
            )  # fmt: skip

    return timed_call(run, engine.device)[0]


def copy_bandwidth(device: torch.device, tier: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of one copy of ``nbytes`` as the tier's warm path makes it: page-locked host to device
    (``ram`` on a GPU), device to device (``gpu``), or host memory to host memory (a CPU run)."""
    elements = nbytes // 2
    if device.type == "cuda" and tier == "ram":
        source = torch.empty(elements, dtype=torch.bfloat16, pin_memory=True)
    else:
        source = torch.empty(elements, dtype=torch.bfloat16, device=device)
    source.fill_(1.0)
    target = torch.empty(elements, dtype=torch.bfloat16, device=device)
    samples = [timed_call(lambda: target.copy_(source, non_blocking=True), device)[0] for _ in range(5)]
    return nbytes / (min(samples[1:]) / 1e3)


def bare_forward_ms(engine: InferenceEngine, document_ids: list[int], new_ids: list[int], repeats: int) -> float:
    """Best time of a forward of only ``new_ids`` over a prebuilt cache holding ``document_ids``' K/V (buffers
    with room for them: the forward writes in place and is cropped back after each timing). The warm request's
    limit uses the tokens it reused as ``document_ids`` and the rest of its prompt (the document's unfinished last
    chunk and the question) as ``new_ids``."""
    model, device = engine.model, engine.device
    layers = [ChunkReuseLayer() for _ in range(kv_entry_shape(model)[0])]
    cache = Cache(layers=layers)
    with torch.inference_mode():
        model(torch.tensor([document_ids], device=device), **{CACHE_ARGUMENT: cache}, use_cache=True, logits_to_keep=1)
        for layer in layers:
            layer.reserve(len(document_ids) + len(new_ids))
        new = torch.tensor([new_ids], device=device)
        positions = torch.arange(len(document_ids), len(document_ids) + len(new_ids), device=device)[None]

        def run() -> None:
            model(new, **{CACHE_ARGUMENT: cache}, position_ids=positions, use_cache=True, logits_to_keep=1)
            cache.crop(-len(new_ids))

        return min(timed_call(run, device)[0] for _ in range(repeats + 1))


def warm_breakdown(engine: InferenceEngine, prompt: str) -> dict[str, float]:
    """ms per phase of one request (warm, or cold on an empty store; see
    :func:`~kvboost_hf.bench.phases.phase_breakdown`)."""
    return phase_breakdown(engine, functools.partial(ttft_ms, engine, prompt))[1]


def outside_dispatch_modes(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with the active dispatch modes (a :class:`CopyCounter`) paused: a compiled
    graph's copies are its own inputs' (none of the reused K/V)."""
    with torch.utils._python_dispatch._disable_current_modes():
        return function(*args, **kwargs)


def warm_copies(engine: InferenceEngine, prompt: str) -> dict[str, Any]:
    """Bytes one warm request copies (all data-moving ops, prompt and 1 decode step) against its reused bytes."""
    caches: list[ChunkReuseCache] = []
    factories = engine.factories  # where the decode loops get their caches
    original = factories.new_cache

    def recording(*args: Any, **kwargs: Any) -> ChunkReuseCache:
        caches.append(original(*args, **kwargs))
        return caches[-1]

    factories.new_cache = recording  # type: ignore[method-assign]
    graph = engine.graphs._graph  # compiled forwards run outside the counter (dynamo refuses dispatch modes)
    engine.graphs._graph = lambda: functools.partial(outside_dispatch_modes, graph())  # type: ignore[method-assign]
    try:
        with CopyCounter() as counter:
            result = engine.generate(prompt, max_new_tokens=2)
    finally:
        del factories.new_cache
        del engine.graphs._graph
    reused = sum(cache.stitched_bytes for cache in caches)
    return {"copied_bytes": counter.total, "reused_bytes": reused, "cached_tokens": result.cached_tokens,
            "by_direction": dict(counter.bytes),
            "copied_over_reused": round(counter.total / reused, 3) if reused else None}  # fmt: skip


def tiers_for(device: torch.device) -> list[str]:
    return ["ram", "gpu"] if device.type == "cuda" else ["ram"]


def store_for(tier: str, device: torch.device) -> ChunkStore:
    gpu_bytes = STORE_BYTES if tier == "gpu" else 0
    return ChunkStore(
        StoreConfig(max_bytes=STORE_BYTES, gpu_max_bytes=gpu_bytes, gpu_device=device if gpu_bytes else None)
    )


def measure_size(engine: InferenceEngine, tokens: int, repeats: int) -> dict[str, Any]:
    """Every figure of one document length (see the module docstring)."""
    document = numbered_document(engine.tokenizer, tokens)
    prompts = [document + document_question(index) for index in range(repeats + 3)]
    prompt_ids = engine.encode(prompts[1])
    row: dict[str, Any] = {"tokens": len(prompt_ids)}
    row["full_ms"] = min(full_prefill_ms(engine, prompt) for prompt in prompts[:repeats])
    # prompts not asked yet, tokenized as a warm request's are (the token ids cache continues the document's ids)
    unseen = [document + document_question(index) for index in range(repeats + 3, repeats + 6)]
    row["tokenize_ms"] = statistics.median(
        timed_call(functools.partial(engine.encode, text), "cpu")[0] for text in unseen
    )
    layers, heads, head_dim = kv_entry_shape(engine.model)
    row["kv_bytes_per_token"] = (
        2 * layers * heads * head_dim * torch.empty(0, dtype=model_dtype(engine.model)).element_size()
    )
    for tier in tiers_for(engine.device):
        engine.store = store_for(tier, engine.device)
        engine.tokens.clear()  # each tier's warm requests tokenize their (distinct) prompts as the first tier's did
        cold_ms, _ = ttft_ms(engine, prompts[0])
        if "cold_ms" not in row:  # once: a second cold request, broken down (its write-back stores the document)
            engine.store.clear()
            engine.tokens.clear()
            row["breakdown_cold"] = warm_breakdown(engine, prompts[0])
            row["cold_ms"] = min(cold_ms, row["breakdown_cold"]["ttft"])  # best of the two, as warm is
        engine.store.flush()
        row[f"warm_{tier}_first_ms"] = ttft_ms(engine, prompts[repeats + 2])[0]
        warm = [ttft_ms(engine, prompt) for prompt in prompts[1 : repeats + 1]]
        row[f"warm_{tier}_ms"] = min(ms for ms, _ in warm)
        row[f"warm_{tier}_cached_tokens"] = cached = warm[0][1].cached_tokens
        if "bare_forward_ms" not in row:  # the tokens the warm request computes, over a cache of those it reuses
            row["new_tokens"] = len(prompt_ids) - cached
            row["bare_forward_ms"] = bare_forward_ms(engine, prompt_ids[:cached], prompt_ids[cached:], repeats)
        reused_bytes = warm[0][1].cached_tokens * row["kv_bytes_per_token"]
        bandwidth = copy_bandwidth(engine.device, tier)
        row[f"{tier}_copy_gb_s"] = round(bandwidth / 1e9, 2)
        row[f"limit_{tier}_ms"] = row["tokenize_ms"] + reused_bytes / bandwidth * 1e3 + row["bare_forward_ms"]
        row[f"breakdown_{tier}"] = warm_breakdown(engine, prompts[repeats + 1])
        row[f"copies_{tier}"] = warm_copies(engine, prompts[repeats + 1])
        engine.store.close()
    return row


def check_sizes(engine: InferenceEngine, sizes: list[int]) -> None:
    """Refuse, before anything runs, a document size whose prompt (the whole numbered sections and a question)
    and 2 new tokens exceed the model's context."""
    for tokens in sizes:
        prompt = len(engine.encode(numbered_document(engine.tokenizer, tokens) + document_question(0)))
        if engine.max_context and prompt + 2 > engine.max_context:
            raise ConfigError(
                f"--sizes {tokens}: its prompt is {prompt} tokens (whole sections and a question) and the model's "
                f"context is {engine.max_context}: ask for at most {engine.max_context - 2 - (prompt - tokens)}"
            )


def run(engine: InferenceEngine, sizes: list[int], repeats: int) -> dict[str, Any]:
    check_sizes(engine, sizes)
    engine.generate("warm-up " * 64, max_new_tokens=2, mode="baseline")  # allocator and kernel start-up
    rows = [measure_size(engine, tokens, repeats) for tokens in tqdm(sizes, desc="document sizes")]
    return {
        "benchmark": "long_context",
        "machine": machine_info(engine.device),
        "model": engine.model.config._name_or_path,
        "dtype": str(model_dtype(engine.model)).removeprefix("torch."),
        "attn_implementation": engine.model.config._attn_implementation,
        "chunk_size": engine.chunking.chunk_size,
        "repeats": repeats,
        "targets": TARGETS,
        "sizes": rows,
    }


def report(result: dict) -> str:
    tiers = [tier for tier in ("ram", "gpu") if f"warm_{tier}_ms" in result["sizes"][0]]
    header = f"{'tokens':>7} {'full ms':>8} {'cold ms':>8}"
    for tier in tiers:
        header += f" {'first':>7} {'warm ' + tier:>9} {'limit':>7} {'x limit':>7} {'speedup':>7}"
    lines = [header]
    for row in result["sizes"]:
        line = f"{row['tokens']:>7} {row['full_ms']:>8.1f} {row['cold_ms']:>8.1f}"
        for tier in tiers:
            warm, limit = row[f"warm_{tier}_ms"], row[f"limit_{tier}_ms"]
            line += f" {row[f'warm_{tier}_first_ms']:>7.1f} {warm:>9.1f} {limit:>7.1f} {warm / limit:>6.2f}x"
            line += f" {row['full_ms'] / warm:>6.1f}x"
        lines.append(line)
    for row in result["sizes"]:
        cold = ", ".join(f"{name} {ms:.1f}" for name, ms in row["breakdown_cold"].items())
        lines.append(f"{row['tokens']} tokens, cold (ms): {cold}")
        for tier in tiers:
            parts = ", ".join(f"{name} {ms:.1f}" for name, ms in row[f"breakdown_{tier}"].items())
            copies = row[f"copies_{tier}"]["copied_over_reused"]
            lines.append(f"{row['tokens']} tokens, warm {tier} (ms): {parts}; copied/reused bytes {copies}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["sizes"]
    tiers = [tier for tier in ("ram", "gpu") if f"warm_{tier}_ms" in rows[0]]
    series = ["full_ms", "cold_ms", *(f"warm_{t}_ms" for t in tiers), *(f"limit_{t}_ms" for t in tiers)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for index, name in enumerate(series):
        positions = [i + index * width for i in range(len(rows))]
        ax.bar(positions, [row[name] for row in rows], width, label=name.removesuffix("_ms"),
               hatch="//" if name.startswith("limit") else None)  # fmt: skip
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [str(row["tokens"]) for row in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    model = f"{result['model'].split('/')[-1]} {result['dtype']} {result['attn_implementation']}"
    ax.set_title(f"Long context, {model}, {result['machine']['device']}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_engine(model: str | None, random_shape: str | None, dtype: str | None, chunk_size: int) -> InferenceEngine:
    if random_shape is not None:
        return random_engine(random_shape, dtype=dtype, chunking=chunk_size)
    return InferenceEngine.from_pretrained(model, dtype=dtype, chunking=chunk_size)


def main(argv: list[str]) -> int:
    parser = parser_for("long_context", __doc__)
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="document lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="questions per figure (best of)")
    parser.add_argument("--chunk-size", type=int, default=ChunkingConfig.chunk_size)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: bf16 on GPU, fp32 CPU")
    parser.add_argument("--attn", help="attn_implementation to run the model with (default: as loaded, sdpa)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--random-shape", choices=sorted(SHAPES), help="random-weight model of this shape")
    source.add_argument("--model", help="a local model directory or hub name (default: the embedded model)")
    args = parser.parse_args(argv)
    engine = build_engine(args.model, args.random_shape, args.dtype, args.chunk_size)
    if args.attn:  # "kvboost" is registered when kvboost_hf is imported
        engine.model.set_attn_implementation(args.attn)
    result = run(engine, [int(size) for size in args.sizes.split(",")], args.repeats)
    save_results(args.out, "long_context", result, report, plot)
    return 0
