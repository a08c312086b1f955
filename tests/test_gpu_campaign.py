"""``python -m kvboost_hf.bench gpu --dry-run``: the campaign's orchestration, run on the CPU with toy shapes."""

from __future__ import annotations

import json
import zipfile

import pytest

from kvboost_hf.bench import gpu


def test_dry_run_records_every_step_and_survives_a_failure_and_a_hang(tmp_path):
    steps = {s.name: s for s in gpu.campaign(dry_run=True)}
    crash = gpu.Step("crash", ("-c", "raise RuntimeError('injected failure')"), 30)
    hang = gpu.Step("hang", ("-c", "import time; time.sleep(60)"), 2)
    order = [steps["tests"], crash, hang, steps["attention"], steps["streaming"]]
    copy = tmp_path / "copy"
    record = gpu.run_campaign(tmp_path / "out", order, budget_s=300, dry_run=True, copy_to=copy)

    saved = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert saved == json.loads(json.dumps(record, default=str)) == json.loads((copy / "gpu.json").read_text())
    assert list(saved["steps"]) == ["tests", "crash", "hang", "attention", "streaming"]
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
    assert saved["steps"]["attention"] == {
        "cap_s": 60,
        "status": "skipped",
        "reason": "needs CUDA; torch.cuda.is_available() is False",
    }

    streaming = saved["steps"]["streaming"]  # the steps after the failure and the hang still ran
    assert streaming["status"] == "passed", streaming["log_tail"]
    result = streaming["results"]["streaming.json"]
    assert result["settings"]["random_shape"] == "tiny" and result["streamed"]["tokens_per_sec"] > 0
    with zipfile.ZipFile(copy / "gpu_files.zip") as archive:
        names = set(archive.namelist())
    assert {"steps/streaming/streaming.json", "steps/streaming/streaming.png", "steps/tests/junit.xml"} <= names
    assert (copy / "gpu.png").stat().st_size > 0


def test_a_second_call_extends_the_record_and_budget_skips(tmp_path):
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
