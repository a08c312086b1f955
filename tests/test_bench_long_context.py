"""``python -m kvboost_hf.bench long_context`` on a toy shape: every figure present, each warm figure with its
limit, the breakdown and the copied bytes beside it (the GPU campaign runs the same code on the 7B shape)."""

from __future__ import annotations

import json

from kvboost_hf.bench import gpu, long_context, phases


def test_long_context_bench_reports_each_warm_figure_with_its_limit(tmp_path):
    argv = ["--random-shape", "tiny", "--sizes", "300,600", "--repeats", "1", "--chunk-size", "32"]
    assert long_context.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "long_context.json").read_text())
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert [row["tokens"] for row in result["sizes"]] == sorted(row["tokens"] for row in result["sizes"])
    for row in result["sizes"]:
        assert row["warm_ram_cached_tokens"] >= row["tokens"] - row["new_tokens"] - 32  # the document was reused
        assert 0 < row["tokenize_ms"] + row["bare_forward_ms"] < row["limit_ram_ms"]
        assert row["ram_copy_gb_s"] > 0 and row["full_ms"] > 0 and row["cold_ms"] > 0 and row["warm_ram_first_ms"] > 0
        assert row["breakdown_cold"]["write_back"] > 0 and row["breakdown_cold"]["copy_into_cache"] == 0
        breakdown = row["breakdown_ram"]
        assert {name for name, _, _ in phases.PHASES} | {"ttft", "other"} == set(breakdown)
        assert breakdown["copy_into_cache"] > 0 and breakdown["forward"] > 0 and breakdown["tokenize"] > 0
        copies = row["copies_ram"]
        assert copies["reused_bytes"] == copies["cached_tokens"] * row["kv_bytes_per_token"] > 0
        assert copies["copied_over_reused"] <= 1.5  # the reused K/V are copied once, plus the new tokens' work
    assert "gpu_ms" not in json.dumps(result)  # no GPU tier on a CPU run


def test_the_campaign_runs_long_context_first():
    for dry_run in (True, False):
        steps = gpu.campaign(dry_run)
        assert steps[0].name == "long_context" and "long_context" in steps[0].argv
        assert "tests/test_reuse_path.py" in next(step for step in steps if step.name == "tests").argv


def test_a_size_past_the_models_context_is_refused_before_anything_runs(monkeypatch):
    """The H200 run of ``--sizes 32768`` on the 32k-context 7B shape measured a full prefill, then failed: a size
    whose prompt cannot fit is now refused first, naming the largest that fits."""
    import pytest

    from kvboost_hf.bench.shapes import random_engine
    from kvboost_hf.core.errors import ConfigError

    engine = random_engine("tiny", dtype="float32")
    engine.max_context = 512  # as the engine reads it from the model's config
    ran: list[str] = []
    monkeypatch.setattr(type(engine), "generate", lambda *args, **kwargs: ran.append("generate"))
    with pytest.raises(ConfigError, match=r"--sizes 600: .*context is 512: ask for at most \d+"):
        long_context.run(engine, [300, 600], repeats=1)
    assert ran == []
