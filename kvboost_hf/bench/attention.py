"""``python -m kvboost_hf.bench attention``: the kvboost Triton kernel against torch SDPA's default backend choice.

The baseline is what ``attn_implementation="sdpa"`` runs: ``scaled_dot_product_attention`` with no backend forced
(``enable_gqa`` and ``is_causal`` as transformers passes them), i.e. torch's own selection (cuDNN attention on
Hopper with torch 2.11). Beside it, each backend forced on its own where the machine has it: FLASH (FA2), cuDNN
and EFFICIENT (a backend without a GQA kernel gets K/V repeated to every head once, outside the timing, and is
marked ``expanded_kv``); a backend the machine lacks is recorded with torch's reason. The ratios and targets count
against the default.

Prefill: causal, ``Lq == Lk``, batch x sequence grid. Decode: one query per sequence against ``Lk`` cached keys,
batch x key-length grid. Both use GQA (``--heads`` query heads over ``--kv-heads`` K/V heads). FLOPs count only
visible (query, key) pairs: ``4 * B * H * D * pairs`` (QK^T and PV, 2 FLOPs per multiply-add). Memory GB/s
count Q, K and V read once and the output written once; on CUDA a device-to-device copy's GB/s (read + write) is
measured beside them as the practical bandwidth ceiling (decode's bound). Times are milliseconds per call (CUDA
events on a GPU), averaged over ``--iters`` back-to-back calls after ``--warmup`` calls.

Without CUDA it runs on the CPU (use tiny shapes): SDPA's CPU backends, and the kernel in the Triton interpreter
when ``TRITON_INTERPRET=1`` (else recorded as unavailable). Those figures check the benchmark's plumbing only; the
record says ``device: cpu``. Writes ``attention.json`` and ``attention.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench.common import pyplot

logger = logging.getLogger(__name__)

BASELINE = "sdpa_default"
# SDPA forced to one backend (a name of torch.nn.attention.SDPBackend), beside the default selection.
FORCED_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}
IMPLEMENTATIONS = ("kvboost", BASELINE, *FORCED_BACKENDS)
TARGETS = {"prefill": 1.0, "decode": 1.0}  # minimum kvboost / default-SDPA throughput ratio (issue 31)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
Attention = Callable[..., torch.Tensor]  # (q, k, v, **options) -> [B, Lq, H, D]


@dataclass
class Case:
    """One measured shape. Per implementation that ran: ms per call, TFLOP/s and memory GB/s; ``unavailable``:
    why the others did not run. ``ratio``: kvboost / default SDPA throughput (``ratio_vs_flash``: / FLASH)."""

    kind: str  # "prefill" or "decode"
    batch: int
    q_len: int
    k_len: int
    ms: dict[str, float] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    gbps: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    expanded_kv: list[str] = field(default_factory=list)
    default_backend: str | None = None  # what torch's default selection picks here, where torch tells
    ratio: float | None = None
    ratio_vs_flash: float | None = None
    max_abs_diff: float | None = None  # kvboost against the default SDPA


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench attention", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for JSON and PNG")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefill-batches", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--prefill-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--decode-batches", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--decode-lens", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per implementation and shape")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per implementation and shape")
    return parser.parse_args(argv)


def _time_ms(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Mean time of ``fn`` in ms over ``iters`` back-to-back calls after ``warmup`` calls (CUDA events on a GPU,
    the wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - started) * 1e3 / iters
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(stop) / iters


def copy_gbps(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s of a device-to-device copy of ``megabytes``, counting the bytes read and the bytes written."""
    source = torch.ones(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source), 1, repeats, device)
    return 2 * source.numel() / ms / 1e6


def _visible_pairs(q_len: int, k_len: int) -> int:
    """(query, key) pairs under bottom-right causal masking: query i sees k_len - q_len + i + 1 keys."""
    offset = k_len - q_len
    return q_len * (offset + 1) + q_len * (q_len - 1) // 2


def sdpa(backend: str | None, causal: bool, gqa: bool) -> Attention:
    """SDPA with ``backend`` forced (a ``SDPBackend`` name; None: torch's default selection), called as
    transformers calls it, returning kvboost's ``[B, Lq, H, D]`` layout (a view)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if backend is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        else:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)

    return call


def default_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool) -> str | None:
    """The backend torch's default selection picks for these inputs (``torch._fused_sdp_choice``, a private
    function: None where this torch lacks it)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=causal, enable_gqa=gqa)).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _measure(case: Case, args: argparse.Namespace, kernel: Attention | None, kernel_missing: str) -> Case:
    """Fill in ``case``: every implementation available on the same random q/k/v."""
    dtype, device = DTYPES[args.dtype], _device()
    shape_q = (case.batch, args.heads, case.q_len, args.head_dim)
    shape_kv = (case.batch, args.kv_heads, case.k_len, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype)
    k, v = torch.randn(shape_kv, device=device, dtype=dtype), torch.randn(shape_kv, device=device, dtype=dtype)
    causal, gqa = case.kind == "prefill", args.heads != args.kv_heads
    case.default_backend = default_backend(q, k, v, causal, gqa)
    expanded: tuple[torch.Tensor, torch.Tensor] | None = None
    calls: dict[str, tuple[Attention, tuple[torch.Tensor, ...]]] = {}
    if kernel is None:
        case.unavailable["kvboost"] = kernel_missing
    else:
        calls["kvboost"] = (functools.partial(kernel, causal=causal), (q, k, v))
    for name, backend in ((BASELINE, None), *FORCED_BACKENDS.items()):
        try:
            sdpa(backend, causal, gqa)(q, k, v)
            calls[name] = (sdpa(backend, causal, gqa), (q, k, v))
            continue
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
        if not gqa:
            case.unavailable[name] = reason
            continue
        if expanded is None:  # once per case, outside every timing
            group = args.heads // args.kv_heads
            expanded = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
        try:
            sdpa(backend, causal, False)(q, *expanded)
        except RuntimeError as exc:
            case.unavailable[name] = str(exc).splitlines()[0] or reason
            continue
        calls[name] = (sdpa(backend, causal, False), (q, *expanded))
        case.expanded_kv.append(name)
    outputs = {name: fn(*inputs) for name, (fn, inputs) in calls.items()}
    if "kvboost" in outputs and BASELINE in outputs:
        case.max_abs_diff = float((outputs["kvboost"].float() - outputs[BASELINE].float()).abs().max())
    flops = 4 * case.batch * args.heads * args.head_dim * _visible_pairs(case.q_len, case.k_len)
    nbytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
    for name, (fn, inputs) in calls.items():
        case.ms[name] = _time_ms(functools.partial(fn, *inputs), args.warmup, args.iters, device)
        case.tflops[name] = flops / case.ms[name] / 1e9
        case.gbps[name] = nbytes / case.ms[name] / 1e6
    if "kvboost" in case.tflops and BASELINE in case.tflops:
        case.ratio = case.tflops["kvboost"] / case.tflops[BASELINE]
    if "kvboost" in case.tflops and "sdpa_flash" in case.tflops:
        case.ratio_vs_flash = case.tflops["kvboost"] / case.tflops["sdpa_flash"]
    return case


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cases(args: argparse.Namespace) -> list[Case]:
    prefill = [Case("prefill", b, n, n) for b in args.prefill_batches for n in args.prefill_lens]
    decode = [Case("decode", b, 1, n) for b in args.decode_batches for n in args.decode_lens]
    return prefill + decode


def _kernel() -> tuple[Attention | None, str]:
    """The kvboost kernel launcher, or None and why it cannot run here."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "no CUDA: the Triton kernel runs on a CPU only in the interpreter (TRITON_INTERPRET=1)"
    try:
        from kvboost_hf.kernels.flash_attention import flash_attention
    except ImportError as exc:
        return None, f"Triton is not importable: {exc}"
    return flash_attention, ""


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict) -> str:
    """TFLOP/s per implementation and shape, kvboost's ratio to the default (and to FLASH), the target verdict."""
    names = ("kvboost", BASELINE, *FORCED_BACKENDS)
    short = [name.removeprefix("sdpa_") for name in names]
    lines = [
        f"{result['device']} ({result['dtype']}, {result['heads']}/{result['kv_heads']} heads, D={result['head_dim']})"
        f": TFLOP/s; ratio = kvboost / default SDPA; * = K/V expanded to every head (no GQA kernel)",
        f"{'kind':8}{'batch':>6}{'q_len':>7}{'k_len':>7}"
        + "".join(f"{name:>10}" for name in short)
        + f"{'picks':>10}{'ratio':>7}{'vs flash':>9}{'target':>8}",
    ]
    for c in result["cases"]:
        verdict = "-"  # the targets are GPU targets
        if c["ratio"] is not None and result["device"] != "cpu":
            verdict = "ok" if c["ratio"] >= result["targets"][c["kind"]] else "MISS"
        cells = "".join(f"{_fmt(c['tflops'].get(n)) + ('*' if n in c['expanded_kv'] else ''):>10}" for n in names)
        picked = (c["default_backend"] or "?").split("_")[0].lower()
        lines.append(
            f"{c['kind']:8}{c['batch']:>6}{c['q_len']:>7}{c['k_len']:>7}{cells}{picked:>10}"
            f"{_fmt(c['ratio'], '.2f'):>7}{_fmt(c['ratio_vs_flash'], '.2f'):>9}{verdict:>8}"
        )
    if result.get("copy_gbps"):
        best = max((c["gbps"].get("kvboost", 0.0) for c in result["cases"] if c["kind"] == "decode"), default=0.0)
        lines.append(
            f"device copy {result['copy_gbps']:.0f} GB/s (read + write); best kvboost decode {best:.0f} GB/s "
            f"({100 * best / result['copy_gbps']:.0f}%)"
        )
    missing = {name: reason for c in result["cases"] for name, reason in c["unavailable"].items()}
    lines += [f"not run: {name}: {reason}" for name, reason in missing.items()]
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, TARGETS, strict=True):
        rows = [c for c in result["cases"] if c["kind"] == kind and c["ratio"] is not None]
        for batch in sorted({c["batch"] for c in rows}):
            series = [c for c in rows if c["batch"] == batch]
            ax.plot([c["k_len"] for c in series], [c["ratio"] for c in series], marker="o", label=f"batch {batch}")
        ax.axhline(TARGETS[kind], color="grey", linestyle="--", label=f"target {TARGETS[kind]}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key length (tokens)")
        ax.set_ylabel("kvboost / default SDPA TFLOP/s")
        ax.set_title(kind)
        ax.legend(fontsize="small")
    fig.suptitle(f"kvboost attention vs torch SDPA (default backend selection), {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Run the benchmark and write ``attention.json`` and ``attention.png``; returns 0."""
    args = parse_args(argv)
    device = _device()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kernel, kernel_missing = _kernel()
    if kernel is None:
        logger.warning("kvboost kernel not run: %s", kernel_missing)
    cases = [_measure(case, args, kernel, kernel_missing) for case in tqdm(_cases(args), desc="attention")]
    result: dict = {
        "device": device_name,
        "interpreted": device.type != "cuda" and kernel is not None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "baseline": BASELINE,
        "targets": TARGETS,
        "copy_gbps": copy_gbps(device) if device.type == "cuda" else None,
        "cases": [asdict(c) for c in cases],
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "attention.png")
    print(f"saved {args.out / 'attention.json'} and {args.out / 'attention.png'} ({device_name})")
    return 0
