"""``python -m kvboost_hf.bench attention``: TFLOP/s of the kvboost Triton kernel against torch SDPA (flash backend).

Prefill: causal, ``Lq == Lk``, batch x sequence grid. Decode: one query per sequence against ``Lk`` cached keys,
batch x key-length grid. Both use GQA (``--heads`` query heads over ``--kv-heads`` K/V heads) in fp16 or bf16.
FLOPs count only visible (query, key) pairs: ``4 * B * H * D * pairs`` (QK^T and PV, 2 FLOPs per multiply-add).
Times are CUDA-event milliseconds per call, averaged over ``--iters`` back-to-back calls after ``--warmup`` calls.
Requires a CUDA GPU; exits with status 1 otherwise (no CPU/interpreter timings are reported).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_hf.bench.common import pyplot

logger = logging.getLogger(__name__)

TARGETS = {"prefill": 0.9, "decode": 1.0}  # minimum kvboost / SDPA-flash throughput ratio
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Case:
    """One measured shape; times in ms per call, throughput in TFLOP/s."""

    kind: str  # "prefill" or "decode"
    batch: int
    q_len: int
    k_len: int
    ms_kvboost: float = 0.0
    ms_sdpa: float = 0.0
    tflops_kvboost: float = 0.0
    tflops_sdpa: float = 0.0
    ratio: float = 0.0
    max_abs_diff: float = 0.0


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


def _time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean CUDA-event time of ``fn`` in ms over ``iters`` back-to-back calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def _visible_pairs(q_len: int, k_len: int) -> int:
    """(query, key) pairs under bottom-right causal masking: query i sees k_len - q_len + i + 1 keys."""
    offset = k_len - q_len
    return q_len * (offset + 1) + q_len * (q_len - 1) // 2


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, gqa: bool) -> torch.Tensor:
    """SDPA restricted to the flash backend, returned in kvboost's ``[B, Lq, H, D]`` layout (a view)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)


def _measure(case: Case, args: argparse.Namespace, kernel: Callable[..., torch.Tensor]) -> Case:
    """Fill in ``case``: both implementations on the same random q/k/v, plus their max abs output difference."""
    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    shape_q = (case.batch, args.heads, case.q_len, args.head_dim)
    shape_kv = (case.batch, args.kv_heads, case.k_len, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=dtype)
    k, v = torch.randn(shape_kv, device=device, dtype=dtype), torch.randn(shape_kv, device=device, dtype=dtype)
    causal = case.kind == "prefill"
    ours = kernel(q, k, v, causal=causal)
    gqa = args.heads != args.kv_heads
    try:
        reference = _sdpa_flash(q, k, v, causal, gqa)
    except RuntimeError:  # a flash backend without GQA support gets K/V repeated once, outside the timing
        group = args.heads // args.kv_heads
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        reference = _sdpa_flash(q, k, v, causal, gqa)
    case.max_abs_diff = float((ours.float() - reference.float()).abs().max())
    case.ms_kvboost = _time_ms(lambda: kernel(q, k, v, causal=causal), args.warmup, args.iters)
    case.ms_sdpa = _time_ms(lambda: _sdpa_flash(q, k, v, causal, gqa), args.warmup, args.iters)
    flops = 4 * case.batch * args.heads * args.head_dim * _visible_pairs(case.q_len, case.k_len)
    case.tflops_kvboost = flops / case.ms_kvboost / 1e9
    case.tflops_sdpa = flops / case.ms_sdpa / 1e9
    case.ratio = case.tflops_kvboost / case.tflops_sdpa
    return case


def _cases(args: argparse.Namespace) -> list[Case]:
    prefill = [Case("prefill", b, n, n) for b in args.prefill_batches for n in args.prefill_lens]
    decode = [Case("decode", b, 1, n) for b in args.decode_batches for n in args.decode_lens]
    return prefill + decode


def _print_table(cases: list[Case]) -> None:
    header = f"{'kind':8}{'batch':>6}{'q_len':>7}{'k_len':>7}{'kvboost':>10}{'sdpa':>10}{'ratio':>7}{'target':>8}"
    print(header + "   (TFLOP/s)")
    for c in cases:
        verdict = "ok" if c.ratio >= TARGETS[c.kind] else "MISS"
        print(
            f"{c.kind:8}{c.batch:>6}{c.q_len:>7}{c.k_len:>7}{c.tflops_kvboost:>10.1f}{c.tflops_sdpa:>10.1f}"
            f"{c.ratio:>7.2f}{verdict:>8}"
        )


def _plot(cases: list[Case], device_name: str, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, TARGETS, strict=True):
        rows = [c for c in cases if c.kind == kind]
        for batch in sorted({c.batch for c in rows}):
            series = [c for c in rows if c.batch == batch]
            ax.plot([c.k_len for c in series], [c.ratio for c in series], marker="o", label=f"batch {batch}")
        ax.axhline(TARGETS[kind], color="grey", linestyle="--", label=f"target {TARGETS[kind]}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key length (tokens)")
        ax.set_ylabel("kvboost / SDPA-flash TFLOP/s")
        ax.set_title(f"{kind}")
        ax.legend(fontsize="small")
    fig.suptitle(f"kvboost attention vs torch SDPA (flash) on {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Run the benchmark; returns 0 on success, 1 when CUDA or Triton is unavailable."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "attention benchmark needs a CUDA GPU (torch.cuda.is_available() is False); "
            "CPU/interpreter timings are not meaningful and are not reported",
            file=sys.stderr,
        )
        return 1
    try:
        import triton

        from kvboost_hf.kernels.flash_attention import flash_attention
    except ImportError as exc:
        print(f"attention benchmark needs Triton: {exc}", file=sys.stderr)
        return 1
    device_name = torch.cuda.get_device_name()
    logger.info("benchmarking on %s", device_name)
    cases = [_measure(case, args, flash_attention) for case in tqdm(_cases(args), desc="attention", unit="shape")]
    _print_table(cases)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "targets": TARGETS,
        "cases": [asdict(c) for c in cases],
    }
    (args.out / "attention.json").write_text(json.dumps(report, indent=2))
    _plot(cases, device_name, args.out / "attention.png")
    print(f"saved {args.out / 'attention.json'} and {args.out / 'attention.png'} ({device_name})")
    return 0
