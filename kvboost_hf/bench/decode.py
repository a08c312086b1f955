"""``python -m kvboost_hf.bench decode``: decode speed of resident models against their memory-bandwidth bound.

For each random-weight shape (``--shapes``, :mod:`kvboost_hf.bench.shapes`; default the Qwen2.5 7B and 14B shapes)
and batch size (``--batches``, default 1, 8, 32), every row is prefilled with ``--context`` random tokens, then
``--steps`` greedy decode steps are timed (after ``--warmup`` untimed ones) in each arm (``--arms``):

* ``eager``: the default :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (growing buffers), ``model.forward``
  called eagerly, as the engine runs today;
* ``static``: the same cache in static mode (``max_cache_len``), eagerly: what the capacity-wide attention costs;
* ``compiled``: the static cache stepped by :class:`~kvboost_hf.hf.graphs.GraphedDecoder`:
  ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)``, so on CUDA the decode
  step is captured as a CUDA graph and replayed; the batch is padded up to its rows bucket (padded rows are not
  counted in tok/s). ``--compile-backend`` picks another backend; on a CPU the default is ``eager``, which traces
  and checks without code generation.

* ``engine`` / ``engine_graphed``: the whole product path, :meth:`InferenceEngine.generate_batch` on the same
  prompts (decoded to text and tokenized again, so about ``--context`` tokens) for ``--steps`` new tokens, graphs
  off / on (:class:`~kvboost_hf.hf.graphs.GraphConfig`, ``--compile-backend``; a batch between two row buckets,
  e.g. 3 or 5, runs through the next bucket's graph, padded); its tok/s is the rows' decode rates summed (each
  row's tokens after the first over the time from its first token), its warm-up the first call (compiles and
  captures included). Needs a tokenizer (``KVBOOST_HF_TOKENIZER`` or the embedded model's). ``engine_graphed``
  launches each greedy step ahead where it can (``GraphConfig.look_ahead``, on by default on CUDA: the host's work
  on a step's tokens overlaps the device's next step); ``steps_ahead`` and ``steps_ahead_dropped`` count them.
* ``engine_serial``: ``engine_graphed`` with ``look_ahead=False`` (each step launched once the host took the last
  one's tokens): beside ``engine_graphed``, what the overlap gains.
* ``engine_warmed``: ``engine_graphed`` after :meth:`InferenceEngine.warm_up_graphs` of the batch's shape (rows x
  its longest prompt plus ``--steps``): ``graph_warm_up_s`` is what the warm-up took (the compile moved out of the
  requests' path), ``warmup_s`` the first call after it. Every engine arm reports ``request_compiles``, the graphs
  dynamo compiled during its two calls (0 once warmed up). ``--temperature T`` (above 0) samples every row of the
  engine arms, seeded, as a chat backend decodes: the host's choice of sampled rows is then in every step.

Each step is what a decode loop does: one forward of one token per row (``logits_to_keep=1``), the greedy token
taken on the device, the cache's ``record`` (its host bookkeeping). Reported per arm, as medians over the timed
steps: tokens/s, ms per step, ms of the forward (its mask built, wall time to its end, the device synchronised
after it) and
**host ms per step outside the forward** (the rest of the step); and beside each figure its bound: bytes read per
step (the weights a forward reads, i.e. all parameters but an untied input embedding, plus every layer's K/V of
the context, ``2 * layers * batch * kv_heads * tokens * head_dim`` elements) at the device's read bandwidth
measured in the same run (a ``--copy-mb`` device-to-device copy: bytes read plus bytes written per second), and
the share of that bound reached. The arms' greedy tokens are compared (``tokens_agree``: identical in fp32;
bf16 may differ after a few tokens).

``--profile-steps N`` profiles N more steps of each arm (``torch.profiler``, CPU and CUDA activities): device
time per step (the kernels' total), the host's synchronisations per step (runtime calls that wait on the device:
stream/device synchronize, blocking copies to the host) and the top operations by device time, so a step that is
slow for its bytes shows where it waits.

Writes ``decode.json`` (after every configuration, so a run cut short keeps what it measured) and ``decode.png``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.profiling import profile_call, profile_report
from kvboost_hf.bench.shapes import SHAPES, random_model
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder, pad_rows
from kvboost_hf.hf.models import forward_read_bytes, resolve_device
from kvboost_hf.hf.prefill import forward
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig

ARMS = ("eager", "static", "compiled", "engine", "engine_graphed", "engine_serial", "engine_warmed")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_for("decode", __doc__)
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-14b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--batches", default="1,8,32", help="comma list of batch sizes (rows)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per row before decoding")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per arm")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (compilation, capture)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--device", default=None, help="compute device (default: cuda when available)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on CUDA)")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth test copy (MB)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profiled steps per arm after the timed ones")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the engine arms' sampling temperature (0: greedy; above: every row sampled, seeded, as a chat backend "
        "decodes); the other arms decode greedily",
    )
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r}; choose from {ARMS}")
    return args


def read_bandwidth(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy of ``megabytes`` moves (read plus written; median of
    ``repeats``): the rate at which a memory-bound forward can read its weights and K/V."""
    nbytes = megabytes << 20
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * nbytes / statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes(model: PreTrainedModel, rows: int, tokens: float) -> float:
    """Bytes of K/V one decode forward must read for ``rows`` rows of ``tokens`` context tokens."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * rows * config.num_key_value_heads * tokens * head_dim * element


def decode_arm(model: PreTrainedModel, arm: str, prompt: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill ``prompt`` (rows x context) through a fresh cache of ``arm``, run ``args.warmup`` then
    ``args.steps`` greedy decode steps (:class:`~kvboost_hf.hf.graphs.GraphedDecoder`: graphed in the ``compiled``
    arm, the batch padded up to its rows bucket); the timed steps' figures and the real rows' greedy tokens."""
    rows, context = prompt.shape
    capacity = context + args.warmup + args.steps + args.profile_steps
    decoder = GraphedDecoder(model, GraphConfig(enabled=arm == "compiled", backend=args.compile_backend))
    padded = pad_rows(prompt, decoder.rows_for(rows))
    cache = ChunkReuseCache(
        ChunkStore(StoreConfig(1 << 20)),
        model,
        mode="baseline",
        write_back=False,
        adapter=False,
        max_cache_len=None if arm == "eager" else capacity,
    )
    torch._dynamo.reset()
    with torch.inference_mode():
        out = forward(model, cache, input_ids=padded, attention_mask=torch.ones_like(padded), logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    forward_s: list[float] = []
    outside_s: list[float] = []
    warmup_s = 0.0
    for step in range(args.warmup + args.steps):
        position = torch.full_like(token, context + step)
        started = time.perf_counter()
        logits = decoder.step(cache, token, position)
        synchronize(prompt.device)
        forwarded = time.perf_counter()
        cache.record(token)
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        finished = time.perf_counter()
        if step < args.warmup:
            warmup_s += finished - started
        else:
            forward_s.append(forwarded - started)
            outside_s.append(finished - forwarded)
    step_ms = [1e3 * (a + b) for a, b in zip(forward_s, outside_s, strict=True)]
    profile = profile_steps(decoder, cache, token, context + args.warmup + args.steps, args.profile_steps)
    return {
        **profile,
        "step_ms": statistics.median(step_ms),
        "forward_ms": 1e3 * statistics.median(forward_s),
        "host_outside_forward_ms": 1e3 * statistics.median(outside_s),
        "tok_per_s": rows / (statistics.median(step_ms) / 1e3),
        "warmup_s": warmup_s,
        "rows_run": padded.shape[0],
        "capacity_tokens": None if arm == "eager" else capacity,
        "graphed_steps": decoder.graphed_steps,
        "capture_bytes": decoder.capture_bytes,
        "tokens": torch.cat(tokens, dim=1)[:rows].tolist(),
    }


def profile_steps(
    decoder: GraphedDecoder, cache: ChunkReuseCache, token: torch.Tensor, position: int, steps: int
) -> dict[str, Any]:
    """``steps`` more decode steps under the profilers (:func:`~kvboost_hf.bench.profiling.profile_call`): device ms
    and synchronising host calls per step, the top operations and Python functions (empty when ``steps`` is 0)."""
    if steps <= 0:
        return {}

    def run_steps() -> None:
        nonlocal token
        for step in range(steps):
            logits = decoder.step(cache, token, torch.full_like(token, position + step))
            cache.record(token)
            token = logits.argmax(-1, keepdim=True)

    return profile_call(run_steps, token.device, steps)[1]


SAMPLING_SEED = 0
"""The engine arms' seed when they sample (``--temperature`` above 0): every arm draws alike."""


def engine_options(temperature: float) -> dict[str, Any]:
    """``generate_batch`` options of the engine arms at ``temperature`` (0: greedy; else seeded sampling)."""
    return {"temperature": temperature, "seed": SAMPLING_SEED if temperature > 0 else None}


def profile_engine(engine: Any, texts: list[str], steps: int, temperature: float = 0.0) -> dict[str, Any]:
    """One more ``generate_batch`` of ``texts`` for ``steps`` tokens under the profilers: per token step its wall ms,
    the device's kernel ms and the synchronising host calls, the top operations by host time and the Python
    functions by cumulative time (where an engine step's host work goes: the gap between wall and device time; the
    prompts' prefill is in the call, so ask for enough steps to amortise it); empty when ``steps`` is 0."""
    if steps <= 0:
        return {}
    options = engine_options(temperature)
    return profile_call(lambda: engine.generate_batch(texts, steps, **options), engine.device, steps)[1]


def engine_arm(model: PreTrainedModel, arm: str, prompt: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """``generate_batch`` of ``prompt``'s rows (as text) through an engine on ``model``, graphs off or on (warmed up
    first for ``engine_warmed``: its seconds ``graph_warm_up_s``): an untimed first call (its seconds:
    ``warmup_s``), then the timed one; the rows' summed decode rate, the graphs' counters and the graphs compiled
    during the two calls."""
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    from kvboost_hf.bench.shapes import tokenizer_dir
    from kvboost_hf.engine import InferenceEngine

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    look_ahead = False if arm == "engine_serial" else None  # None: GraphConfig's default (on CUDA)
    graphs = GraphConfig(enabled=arm != "engine", backend=args.compile_backend, look_ahead=look_ahead)
    engine = InferenceEngine(model, tokenizer, graphs=graphs, store=StoreConfig(1 << 30))
    texts = [tokenizer.decode(row) for row in prompt.tolist()]
    torch._dynamo.reset()
    warm_up_s = None
    if arm == "engine_warmed":
        tokens = max(len(engine.encode(text)) for text in texts) + args.steps
        warm_up_s = engine.warm_up_graphs([(len(texts), tokens)]).seconds
    compiled_before = counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    engine.generate_batch(texts, args.steps, **engine_options(args.temperature))
    warmup_s = time.perf_counter() - started
    results = engine.generate_batch(texts, args.steps, **engine_options(args.temperature))
    stats = engine.cache_stats()
    profiled = profile_engine(engine, texts, args.profile_steps, args.temperature)
    return {
        **profiled,
        "tok_per_s": sum(result.tokens_per_sec for result in results),
        "step_ms": 1e3 * len(results) / max(sum(result.tokens_per_sec for result in results), 1e-9),
        "forward_ms": None,
        "host_outside_forward_ms": float("nan"),
        "warmup_s": warmup_s,
        "graph_warm_up_s": warm_up_s,
        "request_compiles": counters["stats"]["unique_graphs"] - compiled_before,
        "rows_run": len(results),
        "graphed_steps": stats["graph_graphed_steps"],
        "steps_ahead": stats["steps_ahead"],
        "steps_ahead_dropped": stats["steps_ahead_dropped"],
        "capture_bytes": stats["graph_capture_bytes"],
        "tokens": [result.output_ids for result in results],
    }


def measure_shape(shape: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> list[dict]:
    """Every batch and arm on one random-weight model of ``shape`` (built once, freed after)."""
    model = random_model(shape, device=device, dtype=args.dtype)
    backend = args.compile_backend or ("inductor" if device.type == "cuda" else "eager")  # GraphConfig's default
    weights = forward_read_bytes(model)
    rows_out = []
    for batch in map(int, args.batches.split(",")):
        generator = torch.Generator().manual_seed(batch)
        prompt = torch.randint(1, model.config.vocab_size, (batch, args.context), generator=generator).to(device)
        mean_context = args.context + args.warmup + (args.steps - 1) / 2  # tokens attended, mean over timed steps
        step_bytes = weights + kv_bytes(model, batch, mean_context)
        bound_tok_s = batch * bandwidth / step_bytes
        arms: dict[str, Any] = {}
        for arm in args.arms.split(","):
            run_arm = engine_arm if arm.startswith("engine") else decode_arm
            figures = run_arm(model, arm, prompt, args)
            figures["share_of_bound"] = figures["tok_per_s"] / bound_tok_s
            arms[arm] = figures
            print(
                f"{shape} batch {batch} {arm:>8}: {figures['tok_per_s']:9.1f} tok/s "
                f"({figures['share_of_bound']:6.1%} of {bound_tok_s:9.1f}), step {figures['step_ms']:7.2f} ms, "
                f"host outside forward {figures['host_outside_forward_ms']:6.2f} ms",
                flush=True,
            )
            if "profile_table" in figures:
                print(profile_report(figures, "step"), flush=True)
        references: dict[bool, Any] = {}  # the first arm of each family (the engine's prompts are text)
        for arm, figures in arms.items():
            family = arm.startswith("engine")
            figures["tokens_agree"] = references.setdefault(family, figures["tokens"]) == figures.pop("tokens")
        rows_out.append(
            {
                "shape": shape,
                "batch": batch,
                "context": args.context,
                "weight_bytes": weights,
                "step_bytes": step_bytes,
                "bound_tok_s": bound_tok_s,
                "compile_backend": backend,
                "arms": arms,
            }
        )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows_out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"decode on {result['machine']['device']} ({result['dtype']}), read bandwidth "
        f"{result['read_bandwidth_gbps']:.0f} GB/s",
        f"{'shape':<14}{'batch':>6}{'arm':>15}{'tok/s':>10}{'bound':>10}{'share':>8}{'step ms':>9}"
        f"{'host ms':>9}{'=':>3}",
    ]
    for row in result["rows"]:
        for arm, figures in row["arms"].items():
            lines.append(
                f"{row['shape']:<14}{row['batch']:>6}{arm:>15}{figures['tok_per_s']:>10.1f}{row['bound_tok_s']:>10.1f}"
                f"{figures['share_of_bound']:>8.1%}{figures['step_ms']:>9.2f}{figures['host_outside_forward_ms']:>9.2f}"
                f"{'y' if figures['tokens_agree'] else 'n':>3}"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Share of the bandwidth bound per configuration and arm."""
    plt = pyplot()
    labels = [f"{row['shape']}\nB={row['batch']}" for row in result["rows"]]
    arms = list(dict.fromkeys(arm for row in result["rows"] for arm in row["arms"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    width = 0.8 / max(len(arms), 1)
    for index, arm in enumerate(arms):
        shares = [100 * row["arms"].get(arm, {}).get("share_of_bound", 0.0) for row in result["rows"]]
        ax.bar([x + index * width for x in range(len(labels))], shares, width, label=arm)
    ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("% of the bandwidth bound")
    ax.set_title(f"decode tok/s against its bound ({result['machine']['device']}, {result['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    bandwidth = read_bandwidth(device, args.copy_mb)
    result: dict[str, Any] = {
        "machine": machine_info(device),
        "dtype": args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
        "read_bandwidth_gbps": bandwidth / 1e9,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": [],
    }
    for shape in args.shapes.split(","):
        result["rows"].extend(measure_shape(shape, args, device, bandwidth))
        save_results(args.out, "decode", result, report, plot)
    return 0
