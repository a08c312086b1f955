"""``python -m kvboost_hf.bench awq``: the AWQ int4 linear and a resident int4 model against bf16.

Parts (``--parts``):

* ``linear``: for each ``--shapes`` (Qwen2.5 shapes of :mod:`.shapes`) its ``q_proj``, ``o_proj``, ``gate_proj`` and
  ``down_proj`` (inputs x outputs), at each ``--rows`` (1: decode, 8 / 64: verify, 512 / 2048: prefill):
  milliseconds of :class:`~kvboost_hf.kernels.awq_linear.AwqInt4Linear` (the Triton kernel on CUDA; the Triton
  interpreter under ``TRITON_INTERPRET=1``; else the plain-torch reference) against ``x @ W`` in the same dtype
  (cuBLAS on CUDA), their ratio, and the int4 path's packed weight bytes per second. CUDA: events around
  ``--iters`` calls after ``--warmup``, each call timed alone (what an eager model pays: launch overhead
  included), and beside it the same call captured in a CUDA graph and replayed ``--iters`` times back to back
  (``*_graph_ms``: the device time alone, what a graphed decode pays); elsewhere wall time.
* ``tune``: for each linear of ``--shapes`` at each ``--tune-rows``, every fused-kernel tiling of
  :data:`TUNE_TILES` (block rows/outputs/inputs, warps, stages) with automatic split-K and without, timed
  graphed on CUDA (wall time under the Triton interpreter: a smoke test; skipped elsewhere); the fastest
  beside the shipped choice, so the kernel's launch table is set from measurements.

Writes ``awq.json`` and ``awq.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.shapes import SHAPES, random_awq_model, random_engine, tokenizer_dir, torch_dtype
from kvboost_hf.bench.streaming import decode
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.models import forward_read_bytes, resolve_device
from kvboost_hf.kernels.awq_int4 import AwqTiles, awq_int4_matmul
from kvboost_hf.kernels.awq_linear import AwqInt4Linear, triton_runs_on
from kvboost_hf.tools.awq_pack import random_awq_linear


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_for("awq", __doc__)
    parser.add_argument("--parts", default="linear,decode", help="comma list of: linear, decode, tune")
    parser.add_argument("--shapes", default="qwen2.5-7b,qwen2.5-14b,qwen2.5-32b", help="shapes of the linear part")
    parser.add_argument("--rows", default="1,8,64,512,2048", help="tokens per linear call (decode .. prefill)")
    parser.add_argument("--group-size", type=int, default=128, help="AWQ inputs per scale (default 128)")
    parser.add_argument("--dtype", default=None, help="activations (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--device", default=None, help="compute device (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per case")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per case")
    parser.add_argument("--decode-shape", choices=sorted(SHAPES), default="qwen2.5-14b", help="decode part's shape")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per timed decode")
    parser.add_argument("--repeats", type=int, default=2, help="timed decodes per model (median)")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth test copy (MB)")
    parser.add_argument("--tune-rows", default="1,8", help="rows of the tune part")
    args = parser.parse_args(argv)
    args.parts = args.parts.split(",")
    if not set(args.parts) <= PARTS:
        parser.error(f"--parts: unknown {sorted(set(args.parts) - PARTS)}")
    return args


PARTS = {"linear", "decode", "tune"}
# (block_m, block_n, block_k, warps, stages) tried by the tune part (48 tilings, each compiled once for its
# specialisation): block_m 1 serves one row (the GEMV), 16 the tensor-core tiles of 2-16 rows
TUNE_TILES = (
    *(AwqTiles(1, n, k, w, st) for n in (64, 128, 256) for k in (64, 128) for w in (4, 8) for st in (1, 3)),
    *(AwqTiles(16, n, k, w, st) for n in (64, 128) for k in (32, 64, 128) for w in (4, 8) for st in (2, 4)),
)


def _timed(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``call`` (CUDA: events, each call timed alone)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def _graphed(call: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call of ``call`` captured once in a CUDA graph and replayed ``iters``
    times between two events (the device time alone: no host launch gaps between replays' kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def linear_cases(shape: str) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of the shape's main linears."""
    fields = SHAPES[shape]
    hidden, mlp = fields["hidden_size"], fields["intermediate_size"]
    return {
        "q_proj": (hidden, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }


def random_linears(
    args: argparse.Namespace, device: torch.device, seed: int
) -> Iterator[tuple[str, str, int, int, AwqInt4Linear]]:
    """(shape, linear name, inputs, outputs, a random int4 layer on ``device``) for each linear of ``--shapes``."""
    generator = torch.Generator().manual_seed(seed)
    for shape in args.shapes.split(","):
        for name, (inputs, outputs) in linear_cases(shape).items():
            shell = torch.nn.Linear(inputs, outputs, bias=False, device="meta")
            words = torch.randint(-(2**31), 2**31, (inputs, outputs // 8), generator=generator, dtype=torch.int64)
            layer = random_awq_linear(shell, args.group_size, words.to(torch.int32), 0.02, device)
            yield shape, name, inputs, outputs, layer


def linear_speed(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for shape, name, inputs, outputs, layer in random_linears(args, device, seed=0):
        weight = torch.randn(inputs, outputs, device=device, dtype=dtype).mul_(0.02)  # drawn where it runs
        for rows in rows_list:
            x = torch.randn(rows, inputs, device=device, dtype=dtype)
            with torch.no_grad():
                int4_ms = _timed(lambda: layer(x), device, args.warmup, args.iters)  # noqa: B023
                dense_ms = _timed(lambda: x @ weight, device, args.warmup, args.iters)  # noqa: B023
                graphed = (
                    {
                        "int4_graph_ms": _graphed(lambda: layer(x), args.iters),  # noqa: B023
                        "dense_graph_ms": _graphed(lambda: x @ weight, args.iters),  # noqa: B023
                    }
                    if device.type == "cuda"
                    else {}
                )
            results.append({
                "shape": shape, "linear": name, "inputs": inputs, "outputs": outputs, "rows": rows,
                "int4_ms": int4_ms, "dense_ms": dense_ms, "speedup": dense_ms / int4_ms,
                "int4_weight_gbps": layer.packed_bytes / int4_ms / 1e6,
                "dense_weight_gbps": weight.numel() * weight.element_size() / dense_ms / 1e6,
                **graphed,
            })  # fmt: skip
    return results


def tune(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per linear and row count: graphed ms of every :data:`TUNE_TILES` tiling (automatic split-K and none),
    the fastest, and the shipped choice's ms (``tiles=None``)."""
    if not triton_runs_on(device):
        return []
    timer = _graphed if device.type == "cuda" else lambda call, iters: _timed(call, device, 1, iters)
    results = []
    for shape, name, inputs, outputs, layer in random_linears(args, device, seed=1):
        operands = (layer.qweight, layer.qzeros, layer.scales, layer.group_size)
        for rows in map(int, args.tune_rows.split(",")):
            x = torch.randn(rows, inputs, device=device, dtype=dtype)
            reference = awq_int4_matmul(x, *operands).float()
            shipped = timer(lambda: awq_int4_matmul(x, *operands), args.iters)  # noqa: B023
            tried: list[dict[str, Any]] = []
            for tiles in TUNE_TILES:
                if (tiles.block_m == 1) != (rows == 1) or layer.group_size % tiles.block_k:
                    continue
                for splits in (None, 1):

                    def call(tiles: AwqTiles = tiles, splits: int | None = splits) -> torch.Tensor:
                        return awq_int4_matmul(x, *operands, tiles=tiles, splits=splits)  # noqa: B023

                    try:
                        error = float((call().float() - reference).norm() / reference.norm())
                        ms = timer(call, args.iters)
                    except Exception as failure:  # a tiling the device cannot run (out of shared memory, registers)
                        tried.append({"tiles": vars(tiles), "splits": splits, "failed": repr(failure)[:200]})
                        continue
                    tried.append({"tiles": vars(tiles), "splits": splits, "ms": ms, "rel_error": error})
            timed = [t for t in tried if "ms" in t and t["rel_error"] < 1e-2]
            best = min(timed, key=lambda t: t["ms"]) if timed else None
            results.append({
                "shape": shape, "linear": name, "inputs": inputs, "outputs": outputs, "rows": rows,
                "shipped_ms": shipped, "best": best, "tried": len(tried),
                "failed": sum("failed" in t for t in tried),
                "packed_gbps_best": layer.packed_bytes / best["ms"] / 1e6 if best else None,
            })  # fmt: skip
            print(f"tune {shape} {name} rows {rows}: shipped {shipped:.4f} ms, best {best}", flush=True)
    return results


def device_bandwidth(device: torch.device, megabytes: int) -> float:
    """GB/s of a device-to-device copy, read plus write (on CPU: a memcpy, the same count)."""
    source = torch.ones(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = _timed(lambda: target.copy_(source), device, 2, 5)
    return 2 * source.numel() / ms / 1e6


def resident_decode(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    bandwidth = device_bandwidth(device, args.copy_mb)
    rows: dict[str, Any] = {"device_copy_gbps": bandwidth}
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    builders = {
        "int4": lambda: InferenceEngine(
            random_awq_model(args.decode_shape, device=device, dtype=dtype, group_size=args.group_size),
            tokenizer, chunking=64,
        ),
        str(dtype).removeprefix("torch."): lambda: random_engine(args.decode_shape, device=device, dtype=dtype,
                                                                 chunking=64),
    }  # fmt: skip
    for name, build in builders.items():
        engine = build()
        measured = decode(engine, args.new_tokens, args.repeats)
        per_token = forward_read_bytes(engine.model)
        rows[name] = {
            **measured,
            "weight_bytes_per_token": per_token,
            "bound_tokens_per_sec": bandwidth * 1e9 / per_token,
        }
        rows[name]["share_of_bound"] = measured["tokens_per_sec"] / rows[name]["bound_tokens_per_sec"]
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dense = rows[str(dtype).removeprefix("torch.")]
    rows["int4_speedup"] = rows["int4"]["tokens_per_sec"] / dense["tokens_per_sec"]
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, Any] = {
        "machine": machine_info(device),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "linear": linear_speed(args, device, dtype) if "linear" in args.parts else [],
        "decode": resident_decode(args, device, dtype) if "decode" in args.parts else None,
        "tune": tune(args, device, dtype) if "tune" in args.parts else [],
    }
    return result


def report(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [f"AWQ int4 on {machine['device']} ({machine.get('gpu', 'no GPU')})"]
    if result["linear"]:
        lines.append(f"{'shape':14} {'linear':10} {'K x N':>12} {'rows':>5} {'int4 ms':>9} {'dense ms':>9} "
                     f"{'speedup':>8} {'int4 GB/s':>10}")  # fmt: skip
        for row in result["linear"]:
            lines.append(
                f"{row['shape']:14} {row['linear']:10} {row['inputs']:>5}x{row['outputs']:<6} {row['rows']:>5} "
                f"{row['int4_ms']:9.3f} {row['dense_ms']:9.3f} {row['speedup']:7.2f}x {row['int4_weight_gbps']:10.1f}"
                + (
                    f"  graphed {row['int4_graph_ms']:.4f} vs {row['dense_graph_ms']:.4f} ms "
                    f"({row['dense_graph_ms'] / row['int4_graph_ms']:.2f}x)"
                    if "int4_graph_ms" in row
                    else ""
                )
            )
    for row in result["tune"]:
        best = row["best"]
        lines.append(
            f"tune {row['shape']} {row['linear']} rows {row['rows']}: shipped {row['shipped_ms']:.4f} ms"
            + (
                f", best {best['ms']:.4f} ms ({row['packed_gbps_best']:.0f} GB/s packed) with {best['tiles']} "
                f"splits={best['splits']}"
                if best
                else ", no tiling ran"
            )
        )
    decoded = result["decode"]
    if decoded is not None:
        lines.append(f"resident decode of {result['settings']['decode_shape']}, device copy "
                     f"{decoded['device_copy_gbps']:.1f} GB/s:")  # fmt: skip
        for name, row in decoded.items():
            if isinstance(row, dict):
                lines.append(
                    f"  {name:9} {row['tokens_per_sec']:8.2f} tok/s, {row['weight_bytes_per_token'] / 1e9:.2f} GB "
                    f"per token, bound {row['bound_tokens_per_sec']:.1f} tok/s ({100 * row['share_of_bound']:.0f}%)"
                )
        lines.append(f"  int4 / dense decode: {decoded['int4_speedup']:.2f}x")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    rows = result["linear"]
    if rows:
        labels = [f"{r['shape'].removeprefix('qwen2.5-')} {r['linear']} M={r['rows']}" for r in rows]
        ax.barh(labels, [r["speedup"] for r in rows], color="tab:green")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("dense ms / int4 ms (>1: int4 faster)")
        ax.tick_params(axis="y", labelsize=6)
    ax.set_title(f"AWQ int4 linear vs dense on {result['machine'].get('gpu', result['machine']['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    save_results(args.out, "awq", run(args), report, plot)
    return 0
