"""``python -m kvboost_hf.bench streaming``: decode speed and memory of layer streaming against a resident model.

One model (default: the embedded SmolLM2-135M; ``--random-shape``: random weights of a real shape) is loaded
once and measured twice with greedy ``baseline`` generation (no chunk reuse, so only the weights' path differs):
resident, then with ``enable_layer_streaming(model, LayerStreamingConfig(...))``. Reported:

* copy bandwidth: on CUDA host-to-device GB/s from pinned and from pageable memory (256 MB copies, events);
  on CPU the host memcpy GB/s that the CPU streamer's synchronous copies run at (no H2D to measure);
* decode tokens/s (median of ``--repeats`` runs; first token excluded) and the device memory: on CUDA the peak
  allocated bytes, on CPU the bytes of the model's tensors resident on the "device" plus the slots;
* streamed bytes per generated token and the ideal bound ``bandwidth / streamed bytes per token`` (pinned H2D
  on CUDA, memcpy on CPU), with the measured streamed speed as a share of it;
* time waiting on copies (CUDA: compute stream stalls measured with events; CPU: the synchronous copies) against
  the rest of the decode time: the copy/compute split.

Writes ``streaming.json`` and ``streaming.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.shapes import SHAPES, random_engine
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming, layer_streamer

PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky looks blue and sunsets red."}]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_for("streaming", __doc__)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="hub name or local directory (default: the embedded model)")
    model.add_argument("--random-shape", choices=sorted(SHAPES), help="random-weight model of this shape (timing)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--device", default=None, help="compute device (default: cuda when available)")
    parser.add_argument("--keep-first-k", type=int, default=1, help="first decoder layers kept resident")
    parser.add_argument("--keep-last-k", type=int, default=1, help="last decoder layers kept resident")
    parser.add_argument("--num-slots", type=int, default=2, help="device slots (2 = double buffering)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    parser.add_argument("--copy-mb", type=int, default=256, help="size of the bandwidth test copies (MB)")
    return parser.parse_args(argv)


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int = 5) -> dict[str, Any]:
    """GB/s of host-to-device copies (CUDA: pinned and pageable sources) or of host memcpy (CPU)."""
    nbytes = megabytes << 20
    if device.type != "cuda":
        source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        target.copy_(source)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - started)
        return {
            "h2d_skipped": f"no CUDA device ({device}): host-to-device bandwidth not measured",
            "memcpy_gbps": nbytes / statistics.median(times) / 1e9,
        }
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result: dict[str, Any] = {}
    for name, pinned in (("pinned", True), ("pageable", False)):
        source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        target.copy_(source, non_blocking=pinned)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=pinned)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        result[f"h2d_{name}_gbps"] = nbytes / statistics.median(times) / 1e9
    return result


def device_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of the model's parameters and buffers currently on ``device`` (host copies of streamed layers not)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type == device.type}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode(engine: InferenceEngine, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Median decode tok/s over ``repeats`` greedy runs (after an untimed warm-up), their total seconds and
    tokens, and with layer streaming the seconds waited on copies during them."""
    engine.generate(PROMPT, 4, mode="baseline")  # warm-up (lazy repacks, allocator)
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    streamer = layer_streamer(engine.model)
    waited = streamer.stats().wait_seconds if streamer is not None else 0.0
    runs = [engine.generate(PROMPT, new_tokens, mode="baseline") for _ in range(repeats)]
    return {
        "wait_seconds": streamer.stats().wait_seconds - waited if streamer is not None else None,
        "tokens_per_sec": statistics.median(r.tokens_per_sec for r in runs),
        "seconds": sum(r.total_ms for r in runs) / 1e3,
        "generated_tokens": sum(r.generated_tokens for r in runs),
        "streamed_bytes_per_token": runs[-1].streamed_bytes_per_token,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.random_shape is None:
        engine = InferenceEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype, chunking=64)
    else:
        engine = random_engine(args.random_shape, device=args.device, dtype=args.dtype, chunking=64)
    device = engine.device
    bandwidth = copy_bandwidth(device, args.copy_mb)
    resident = decode(engine, args.new_tokens, args.repeats)
    resident["device_bytes"] = device_bytes(engine.model, device)
    settings = LayerStreamingConfig(args.keep_first_k, args.keep_last_k, args.num_slots, device=device)
    handle = enable_layer_streaming(engine.model, settings)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    streamed = decode(engine, args.new_tokens, args.repeats)
    stats = handle.stats()
    streamed["device_bytes"] = (
        device_bytes(engine.model, device) if device.type == "cuda" else stats.resident_bytes + stats.slot_bytes
    )
    handle.close()
    bound_gbps = float(bandwidth.get("h2d_pinned_gbps", bandwidth.get("memcpy_gbps", 0.0)))
    bound = bound_gbps * 1e9 / streamed["streamed_bytes_per_token"]
    return {
        "machine": machine_info(device),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "streaming": {
            "streamed_layers": stats.streamed_layers,
            "resident_layers": stats.resident_layers,
            "bytes_per_forward": stats.bytes_per_forward,
            "slot_bytes": stats.slot_bytes,
            "reloads": stats.reloads,
        },
        "bandwidth": bandwidth,
        "resident": resident,
        "streamed": streamed,
        "bound_tokens_per_sec": bound,
        "share_of_bound": streamed["tokens_per_sec"] / bound,
        "copy_share_of_decode": streamed["wait_seconds"] / streamed["seconds"],
    }


def report(result: dict[str, Any]) -> str:
    res, st, bw = result["resident"], result["streamed"], result["bandwidth"]
    gbps = ", ".join(f"{k} {v:.2f}" for k, v in bw.items() if k.endswith("_gbps"))
    lines = [
        f"streaming benchmark on {result['machine']['device']} ({result['machine'].get('gpu', 'no GPU')})",
        f"copy bandwidth GB/s: {gbps}" + (f"  [{bw['h2d_skipped']}]" if "h2d_skipped" in bw else ""),
        f"{'':10} {'tok/s':>8} {'device MB':>10} {'streamed MB/token':>18}",
        f"{'resident':10} {res['tokens_per_sec']:8.2f} {res['device_bytes'] / 1e6:10.1f} {'-':>18}",
        f"{'streamed':10} {st['tokens_per_sec']:8.2f} {st['device_bytes'] / 1e6:10.1f} "
        f"{st['streamed_bytes_per_token'] / 1e6:18.1f}",
        f"bound (bandwidth / streamed bytes per token): {result['bound_tokens_per_sec']:.2f} tok/s; "
        f"streamed reaches {100 * result['share_of_bound']:.0f}% of it",
        f"time waiting on copies: {st['wait_seconds']:.2f} s of {st['seconds']:.2f} s "
        f"({100 * result['copy_share_of_decode']:.0f}% copy, {100 * (1 - result['copy_share_of_decode']):.0f}% "
        "compute and the rest)",
    ]
    if res["peak_device_bytes"] is not None:
        lines.append(
            f"peak device memory MB: resident {res['peak_device_bytes'] / 1e6:.1f}, streamed "
            f"{st['peak_device_bytes'] / 1e6:.1f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    res, st = result["resident"], result["streamed"]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["resident", "streamed", "bound"]
    values = [res["tokens_per_sec"], st["tokens_per_sec"], result["bound_tokens_per_sec"]]
    speed.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray"])
    speed.set_ylabel("decode tokens/s")
    speed.set_title("decode speed (bound = bandwidth / bytes per token)")
    per_token = 1e3 / max(st["generated_tokens"], 1)
    copy_ms = st["wait_seconds"] * per_token
    split.bar(["streamed"], [copy_ms], label="waiting on copies")
    split.bar(["streamed"], [st["seconds"] * per_token - copy_ms], bottom=[copy_ms], label="compute and the rest")
    split.set_ylabel("ms per generated token")
    split.set_title("copy / compute split")
    split.legend()
    fig.suptitle(f"layer streaming on {result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    save_results(args.out, "streaming", run(args), report, plot)
    return 0
