"""``bench attention`` on the CPU: the default SDPA selection is the baseline, forced backends beside it, the
kernel in the Triton interpreter (conftest turns it on); figures of plumbing only."""

from __future__ import annotations

import json

import torch

from kvboost_hf.bench import attention

TINY = [
    *("--dtype", "float32", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--warmup", "0", "--iters", "1"),
    *("--prefill-batches", "1", "--prefill-lens", "48", "--decode-batches", "2", "--decode-lens", "40"),
]


def test_cpu_run_times_the_default_selection_as_baseline_and_names_what_did_not_run(tmp_path, capsys):
    assert attention.main([*TINY, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention.json").read_text())
    assert result["device"] == "cpu" and result["baseline"] == "sdpa_default" and result["interpreted"] is True
    prefill, decode = result["cases"]
    for case in (prefill, decode):
        assert {"kvboost", "sdpa_default", "sdpa_flash"} <= set(case["ms"])
        assert case["ratio"] == case["tflops"]["kvboost"] / case["tflops"]["sdpa_default"]
        assert case["ratio_vs_flash"] == case["tflops"]["kvboost"] / case["tflops"]["sdpa_flash"]
        assert case["max_abs_diff"] < 1e-4  # fp32: the kernel computes what the default SDPA computes
        assert {"sdpa_cudnn", "sdpa_efficient"} <= set(case["unavailable"])  # CUDA-only backends, with torch's reason
        assert all(reason for reason in case["unavailable"].values())
    assert prefill["kind"] == "prefill" and decode["k_len"] == 40 and decode["q_len"] == 1
    assert prefill["default_backend"] in (None, "FLASH_ATTENTION", "MATH")
    assert (tmp_path / "attention.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "ratio = kvboost / default SDPA" in printed and "not run: sdpa_cudnn" in printed


def test_without_the_interpreter_the_kernel_is_recorded_as_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention.main([*TINY, "--out", str(tmp_path)]) == 0
    case = json.loads((tmp_path / "attention.json").read_text())["cases"][0]
    assert "kvboost" not in case["ms"] and "TRITON_INTERPRET=1" in case["unavailable"]["kvboost"]
    assert case["ratio"] is None and "sdpa_default" in case["ms"]
