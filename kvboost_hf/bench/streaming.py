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

AWQ int4 (``--awq``): the model's decoder linears become :class:`~kvboost_hf.kernels.awq_linear.AwqInt4Linear`
(the Triton kernel on CUDA): with ``--random-shape`` random packed codes built in process
(:func:`~kvboost_hf.bench.shapes.random_awq_model`, no checkpoint), with ``--model`` its round-to-nearest int4 copy
(:func:`~kvboost_hf.tools.awq_pack.int4_model`). A ``--model`` folder holding an AWQ GEMM checkpoint is loaded as
int4 by :func:`~kvboost_hf.tools.awq_load.load_awq_model` (no gptqmodel). The streamer then copies the packed bytes.

``--device-budget 12GB``: :func:`~kvboost_hf.offload.budget.plan_device_memory` picks the resident layers, the
slots and the K/V tokens that fit the budget with ``--workspace`` left for activations and the CUDA context; the
resident run is skipped (the model does not fit the budget: that is the point) and the layers are built in host
memory. Reported beside the plan: peak allocated and reserved bytes and the device's used memory after the run.

``--verify-sizes 1,8,32,64``: the streamed model's verify forward over a chain and over a tree
(``--tree-branching``) of each size after the prompt, against the 1-token forward. With ``--tokens-per-verify``
(a figure measured elsewhere on a real model, its provenance in ``--tokens-per-verify-source``) the projected
speculative tok/s: that many tokens per verify over (the measured tree verify of ``--projection-nodes`` + the
measured forwards of a resident random ``qwen2.5-0.5b`` draft, ``--draft-forwards-per-verify`` of them).

Writes ``streaming.json`` and ``streaming.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from kvboost_hf.bench.common import machine_info, parser_for, pyplot, save_results
from kvboost_hf.bench.shapes import SHAPES, random_awq_model, random_engine, random_model, tokenizer_dir, torch_dtype
from kvboost_hf.bench.speculative_tree import time_verify_forwards
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.models import model_dtype, resolve_device
from kvboost_hf.offload import (
    DevicePlan,
    LayerStreamingConfig,
    decoder_layers,
    enable_layer_streaming,
    layer_device_bytes,
    layer_streamer,
    parse_bytes,
    plan_device_memory,
)
from kvboost_hf.store.config import StoreConfig
from kvboost_hf.tools.awq_load import is_awq_checkpoint, load_awq_model
from kvboost_hf.tools.awq_pack import int4_model

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
    parser.add_argument("--awq", action="store_true", help="AWQ int4 decoder linears (random codes, or RTN of --model)")
    parser.add_argument("--group-size", type=int, default=128, help="AWQ inputs per scale (default 128)")
    parser.add_argument("--device-budget", type=parse_bytes, help="fit the model in this many bytes (e.g. 12GB)")
    parser.add_argument("--workspace", type=parse_bytes, default="1GB", help="left for activations and context")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="K/V tokens the budget must hold at least")
    parser.add_argument("--verify-sizes", type=_sizes, default=[], help="draft sizes of timed verify forwards")
    parser.add_argument("--tree-branching", type=int, default=4, help="children per node of the timed trees")
    parser.add_argument("--tokens-per-verify", type=float, help="measured elsewhere: tokens per verify forward")
    parser.add_argument("--tokens-per-verify-source", default="", help="where --tokens-per-verify was measured")
    parser.add_argument("--projection-nodes", type=int, help="tree size of --tokens-per-verify (default: largest)")
    parser.add_argument("--draft-forwards-per-verify", type=float, default=0.0, help="draft forwards per verify")
    parser.add_argument("--draft-shape", default="qwen2.5-0.5b", help="random-shape draft timed for the projection")
    args = parser.parse_args(argv)
    if args.awq and args.group_size < 16:
        parser.error("--group-size must be at least 16 for the int4 kernel")
    if args.tokens_per_verify is not None and not args.verify_sizes:
        parser.error("--tokens-per-verify needs --verify-sizes (the projection uses the measured verify forward)")
    return args


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


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
    engine.generate(PROMPT, 2, mode="baseline")  # warm-up (lazy repacks, allocator): a prompt and a decode forward
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
        **device_memory(device),
    }


def device_memory(device: torch.device) -> dict[str, int | None]:
    """CUDA: peak bytes allocated and reserved by torch since the last reset, and the device's used memory now
    (every process and the CUDA context included: what ``nvidia-smi`` shows). None elsewhere."""
    if device.type != "cuda":
        return {"peak_device_bytes": None, "peak_reserved_bytes": None, "device_used_bytes": None}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "peak_device_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "device_used_bytes": total - free,
    }


def build_engine(args: argparse.Namespace) -> InferenceEngine:
    """The benchmark's engine: ``--model`` or ``--random-shape``, int4 with ``--awq``; with ``--device-budget`` the
    layers of a random int4 shape are built in host memory and the store keeps no GPU tier."""
    store = StoreConfig(gpu_max_bytes=0) if args.device_budget is not None else None
    host = "cpu" if args.device_budget is not None else None
    if args.model is not None and is_awq_checkpoint(args.model):  # an AWQ checkpoint, loaded without gptqmodel
        dtype = torch_dtype(args.dtype) if args.dtype else torch.float16
        model = load_awq_model(args.model, device=host or resolve_device(args.device), dtype=dtype)
        return InferenceEngine(model, AutoTokenizer.from_pretrained(args.model), chunking=64, store=store)
    if args.random_shape is None:
        engine = InferenceEngine.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, chunking=64, store=store
        )
        if args.awq:
            int4_model(engine.model, args.group_size)
        return engine
    if not args.awq:
        return random_engine(args.random_shape, device=args.device, dtype=args.dtype, chunking=64, store=store)
    device = resolve_device(args.device)
    model = random_awq_model(args.random_shape, device=device, dtype=args.dtype, group_size=args.group_size,
                             layer_device=host)  # fmt: skip
    return InferenceEngine(model, AutoTokenizer.from_pretrained(tokenizer_dir()), chunking=64, store=store)


def budget_plan(engine: InferenceEngine, args: argparse.Namespace) -> DevicePlan:
    """The :func:`plan_device_memory` of ``engine``'s model under ``--device-budget``."""
    model = engine.model
    layers = decoder_layers(model)
    in_layers = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    others = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in in_layers}
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model_dtype(model).itemsize
    return plan_device_memory(
        args.device_budget, [layer_device_bytes(layer) for layer in layers],
        sum(t.numel() * t.element_size() for t in others.values()),
        kv_bytes_per_token=per_token, min_kv_tokens=args.kv_tokens, workspace_bytes=args.workspace,
        num_slots=args.num_slots,
    )  # fmt: skip


def verify_costs(engine: InferenceEngine, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds of one streamed verify forward per draft size, chain and tree, and their ratio to 1 token."""
    prompt = engine.encode(PROMPT)
    sizes = sorted({1, *args.verify_sizes, *([args.projection_nodes] if args.projection_nodes else [])})
    chain = time_verify_forwards(engine.model, prompt, sizes, args.repeats)
    tree = time_verify_forwards(engine.model, prompt, sizes, args.repeats, branching=args.tree_branching)
    one = chain[1]
    return {
        "chain_seconds": chain,
        "tree_seconds": tree,
        "chain_ratio": {n: s / one for n, s in chain.items()},
        "tree_ratio": {n: s / one for n, s in tree.items()},
    }


def projection(verify: dict[str, Any], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Projected speculative tok/s: ``--tokens-per-verify`` / (tree verify seconds + draft forwards x the
    measured forward of a resident random draft over one tree level)."""
    nodes = args.projection_nodes or max(args.verify_sizes)
    measured = verify["tree_seconds"][nodes]
    draft_seconds = 0.0
    if args.draft_forwards_per_verify > 0:
        draft = random_model(args.draft_shape, device=device, dtype=args.dtype)
        level = max(1, min(nodes, args.tree_branching**2))
        draft_seconds = time_verify_forwards(draft, list(range(1, 33)), [level], args.repeats)[level]
        del draft
    seconds = measured + args.draft_forwards_per_verify * draft_seconds
    return {
        "tokens_per_verify": args.tokens_per_verify,
        "tokens_per_verify_source": args.tokens_per_verify_source or "given on the command line",
        "verify_nodes": nodes,
        "verify_seconds": measured,
        "verify_source": f"measured here: streamed verify forward of a {nodes}-node tree on {device}",
        "draft_shape": args.draft_shape,
        "draft_forward_seconds": draft_seconds,
        "draft_forwards_per_verify": args.draft_forwards_per_verify,
        "projected_tokens_per_sec": args.tokens_per_verify / seconds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(args)
    device = resolve_device(args.device)  # the compute device (a budgeted model may still sit in host memory)
    bandwidth = copy_bandwidth(device, args.copy_mb)
    plan = budget_plan(engine, args) if args.device_budget is not None else None
    resident = None
    if plan is None:
        resident = decode(engine, args.new_tokens, args.repeats)
        resident["device_bytes"] = device_bytes(engine.model, device)
        settings = LayerStreamingConfig(args.keep_first_k, args.keep_last_k, args.num_slots, device=device)
    else:
        settings = plan.streaming_config(device=device)
    handle = enable_layer_streaming(engine.model, settings)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    streamed = decode(engine, args.new_tokens, args.repeats)
    stats = handle.stats()
    streamed["device_bytes"] = (
        device_bytes(engine.model, device) if device.type == "cuda" else stats.resident_bytes + stats.slot_bytes
    )
    verify = verify_costs(engine, args) if args.verify_sizes else None
    handle.close("cpu")  # the host: a budgeted model never becomes resident
    del engine, handle
    if device.type == "cuda":
        torch.cuda.empty_cache()
    projected = projection(verify, args, device) if verify and args.tokens_per_verify else None
    bound_gbps = float(bandwidth.get("h2d_pinned_gbps", bandwidth.get("memcpy_gbps", 0.0)))
    per_token = streamed["streamed_bytes_per_token"]
    bound = bound_gbps * 1e9 / per_token if per_token else None  # None: every layer fit the device
    return {
        "plan": None if plan is None else {**asdict(plan), "used_bytes": plan.used_bytes},
        "verify": verify,
        "projection": projected,
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
        "share_of_bound": streamed["tokens_per_sec"] / bound if bound else None,
        "copy_share_of_decode": streamed["wait_seconds"] / streamed["seconds"],
    }


def report(result: dict[str, Any]) -> str:
    res, st, bw = result["resident"], result["streamed"], result["bandwidth"]
    gbps = ", ".join(f"{k} {v:.2f}" for k, v in bw.items() if k.endswith("_gbps"))
    settings = result["settings"]
    what = settings.get("random_shape") or settings.get("model") or "embedded model"
    lines = [
        f"streaming benchmark of {what}{' (AWQ int4)' if settings.get('awq') else ''} on "
        f"{result['machine']['device']} ({result['machine'].get('gpu', 'no GPU')})",
        f"copy bandwidth GB/s: {gbps}" + (f"  [{bw['h2d_skipped']}]" if "h2d_skipped" in bw else ""),
        f"{'':10} {'tok/s':>8} {'device MB':>10} {'streamed MB/token':>18}",
    ]
    if res is not None:
        lines.append(f"{'resident':10} {res['tokens_per_sec']:8.2f} {res['device_bytes'] / 1e6:10.1f} {'-':>18}")
    lines += [
        f"{'streamed':10} {st['tokens_per_sec']:8.2f} {st['device_bytes'] / 1e6:10.1f} "
        f"{st['streamed_bytes_per_token'] / 1e6:18.1f}",
        "nothing streamed: every layer fit the device"
        if result["bound_tokens_per_sec"] is None
        else f"bound (bandwidth / streamed bytes per token): {result['bound_tokens_per_sec']:.2f} tok/s; "
        f"streamed reaches {100 * result['share_of_bound']:.0f}% of it",
        f"time waiting on copies: {st['wait_seconds']:.2f} s of {st['seconds']:.2f} s "
        f"({100 * result['copy_share_of_decode']:.0f}% copy, {100 * (1 - result['copy_share_of_decode']):.0f}% "
        "compute and the rest)",
    ]
    plan = result.get("plan")
    if plan is not None:
        lines.append(
            f"device budget {plan['budget_bytes'] / 1e9:.3f} GB: {plan['resident_layers']} layers resident, "
            f"{plan['streamed_layers']} streamed through {plan['num_slots']} slots, K/V for {plan['kv_tokens']} "
            f"tokens; planned use {plan['used_bytes'] / 1e9:.3f} GB"
        )
    if st["peak_device_bytes"] is not None:
        resident_peak = f"resident {res['peak_device_bytes'] / 1e6:.1f}, " if res is not None else ""
        lines.append(
            f"peak device memory MB: {resident_peak}streamed {st['peak_device_bytes'] / 1e6:.1f} allocated, "
            f"{st['peak_reserved_bytes'] / 1e6:.1f} reserved; device used after the run "
            f"{st['device_used_bytes'] / 1e6:.1f}"
        )
    verify = result.get("verify")
    if verify is not None:
        for shape in ("chain", "tree"):
            cells = ", ".join(
                f"{n}: {1e3 * s:.1f} ms ({verify[f'{shape}_ratio'][n]:.2f}x)"
                for n, s in verify[f"{shape}_seconds"].items()
            )
            lines.append(f"verify forward, {shape} of n nodes: {cells}")
    projected = result.get("projection")
    if projected is not None:
        lines += [
            f"projected speculative decode: {projected['projected_tokens_per_sec']:.2f} tok/s = "
            f"{projected['tokens_per_verify']:.2f} tokens per verify / ({1e3 * projected['verify_seconds']:.1f} ms "
            f"verify + {projected['draft_forwards_per_verify']:.1f} x "
            f"{1e3 * projected['draft_forward_seconds']:.1f} ms {projected['draft_shape']} draft forwards)",
            f"  tokens per verify: {projected['tokens_per_verify_source']}",
            f"  verify forward: {projected['verify_source']}",
        ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    res, st = result["resident"], result["streamed"]
    fig, (speed, split) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["resident", "streamed", "bound"]
    resident = res["tokens_per_sec"] if res is not None else 0.0
    values = [resident, st["tokens_per_sec"], result["bound_tokens_per_sec"] or 0.0]
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
