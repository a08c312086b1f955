"""``bench decode`` as the GPU campaign runs it, dry (toy shape on the CPU): every arm measured against its bound."""

from __future__ import annotations

import pytest

from kvboost_hf.bench import decode, gpu
from kvboost_hf.hf.models import forward_read_bytes


def test_dry_run_decode_step_measures_every_arm_against_its_bound(tmp_path):
    """The campaign's decode step, its command run in this process (``python -m kvboost_hf.bench`` dispatches its
    arguments to ``decode.main``; the campaign's subprocess, time cap and record are tests/test_gpu_campaign.py's:
    here it would only add ~10 s of imports); its results read as the campaign reads a step's folder."""
    from kvboost_hf.bench.__main__ import main as bench

    step = next(s for s in gpu.campaign(dry_run=True) if s.name == "decode")
    folder = tmp_path / "out"
    assert step.argv[:2] == ("-m", "kvboost_hf.bench")
    assert bench([arg.replace("{out}", str(folder)) for arg in step.argv[2:]]) == 0
    result = gpu.step_results(folder)["decode.json"]
    assert result["dtype"] == "float32" and result["read_bandwidth_gbps"] > 0
    assert [(row["shape"], row["batch"]) for row in result["rows"]] == [("tiny", 1), ("tiny", 3)]
    for row in result["rows"]:
        assert row["bound_tok_s"] > 0 and row["step_bytes"] > row["weight_bytes"] > 0
        assert set(row["arms"]) == set(decode.ARMS)
        for arm, figures in row["arms"].items():
            assert figures["tok_per_s"] > 0 and figures["share_of_bound"] > 0
            if not arm.startswith("engine"):  # the engine's steps are not timed one by one
                assert figures["step_ms"] >= figures["host_outside_forward_ms"] > 0
            assert figures["tokens_agree"]  # fp32: static and compiled give the eager tokens, the engine's arms agree
        engine, graphed, serial, warmed = (
            row["arms"][arm] for arm in ("engine", "engine_graphed", "engine_serial", "engine_warmed")
        )
        assert graphed["graphed_steps"] == serial["graphed_steps"] and serial["steps_ahead"] == 0
        assert graphed["steps_ahead"] == 0  # GraphConfig's default looks ahead on CUDA only
        assert engine["graphed_steps"] == 0 and engine["rows_run"] == graphed["rows_run"] == row["batch"]
        # two calls of 3 tokens, the last 2 of each from graphed steps (3 rows through the 4-row graph, padded)
        assert graphed["graphed_steps"] == warmed["graphed_steps"] == 2 * 2
        assert engine["request_compiles"] == 0 and graphed["request_compiles"] == 1  # the first call compiled
        assert warmed["request_compiles"] == 0 and warmed["graph_warm_up_s"] > 0  # compiled before the calls
        assert engine["graph_warm_up_s"] is None and graphed["graph_warm_up_s"] is None
        compiled = row["arms"]["compiled"]
        assert compiled["capacity_tokens"] == 16 + 1 + 3 and compiled["graphed_steps"] == 1 + 3
        assert compiled["rows_run"] == {1: 1, 3: 4}[row["batch"]]  # 3 rows padded up to the bucket of 4
        assert row["arms"]["eager"]["graphed_steps"] == row["arms"]["static"]["graphed_steps"] == 0


def test_decode_bound_counts_the_weights_read_and_the_context_kv():
    from kvboost_hf.bench.shapes import random_model

    model = random_model("tiny", device="cpu")
    embedding = model.get_input_embeddings().weight.numel() * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary frequencies
    assert forward_read_bytes(model) == total - embedding + buffers  # untied: the input table is not read whole
    # 3 layers, K and V, 2 KV heads of 16 dims, fp32
    assert decode.kv_bytes(model, rows=2, tokens=10) == 2 * 3 * 2 * 2 * 10 * 16 * 4


def test_decode_refuses_unknown_shapes_and_arms(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--shapes", "qwen9"])
    with pytest.raises(SystemExit):
        decode.parse_args(["--arms", "eager,warp"])
    assert "warp" in capsys.readouterr().err


def test_an_engine_arm_profiled_reports_wall_device_and_synchronisations_per_step():
    """``--profile-steps`` on the engine's arms (the H200's graphed batch-8 step ran at 43% of its bound with no
    breakdown of where): one more call under the profiler, its wall time per step beside the device's and the
    synchronisations, the top operations by host time."""
    from kvboost_hf.bench.shapes import random_engine

    engine = random_engine("tiny", dtype="float32")
    figures = decode.profile_engine(engine, ["a short prompt", "another prompt here"], 3)
    assert figures["profile_wall_ms_per_step"] > 0 and figures["profile_syncs_per_step"] == 0  # a CPU never waits
    assert figures["profile_device_ms_per_step"] == 0 and "Self CPU" in figures["profile_table"]
    assert figures["profile_sync_sites"] == {} and "where the host waited" not in decode.profile_report(figures, "step")
    assert decode.profile_engine(engine, ["x"], 0) == {}
    sampled = decode.profile_engine(engine, ["a short prompt", "another prompt here"], 3, temperature=0.8)
    assert sampled["profile_wall_ms_per_step"] > 0  # every row sampled (seeded), as a chat backend decodes
    with pytest.raises(SystemExit):
        decode.parse_args(["--temperature", "-1"])


def test_the_gc_timer_counts_collections_by_generation_while_active():
    """``GcTimer``: a full collection inside counts in generation 2 with its ms; one after the block is not seen."""
    import gc

    from kvboost_hf.bench.profiling import GcTimer

    with GcTimer() as timer:
        gc.collect()
    gc.collect()
    assert timer.collections[2] == 1 and timer.ms[2] >= 0.0
    assert timer.as_dict() == {"collections": timer.collections, "ms": [round(ms, 2) for ms in timer.ms]}


def test_sync_sites_name_the_innermost_frame_of_the_package_per_wait():
    """``SyncSites`` (what the GPU runs bring back: where each of a request's synchronisations is called): grouped by
    the innermost ``kvboost_hf`` frame outside the benchmarks, else the innermost frame; the stacks numbered."""
    import traceback

    from kvboost_hf.bench.profiling import SYNC_WARNING, SyncSites, profile_report

    def stack(*frames: tuple[str, int, str]) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([traceback.FrameSummary(f, n, name) for f, n, name in frames])

    sites = SyncSites()
    with sites:  # on a CPU it records nothing by itself
        pass
    assert sites.stacks == []
    bench = ("/x/kvboost_hf/bench/decode.py", 3, "run")
    step = ("/x/kvboost_hf/hf/decode.py", 540, "step")
    sample = ("/x/kvboost_hf/hf/sampling.py", 88, "sample")
    torch_frame = ("/y/torch/cuda/__init__.py", 7, "synchronize")
    sites.stacks = [stack(bench, step, sample, torch_frame), stack(bench, step, torch_frame)]
    sites.stacks += [stack(bench, step, sample, torch_frame), stack(torch_frame)]
    assert sites.by_site() == {
        "hf/sampling.py:88 sample": 2,
        "hf/decode.py:540 step": 1,
        "/y/torch/cuda/__init__.py:7 synchronize": 1,
    }
    assert sites.report().count("--- synchronisation") == 4 and "sampling.py" in sites.report()
    sites._record(UserWarning("a warning of another kind"))
    assert len(sites.stacks) == 4
    sites._record(UserWarning(f"{SYNC_WARNING} CUDA operation"))
    assert (
        len(sites.stacks) == 5
        and sites.stacks[-1][-1].name == "test_sync_sites_name_the_innermost_frame_of_the_package_per_wait"
    )
    figures = {"profile_wall_ms_per_step": 1.0, "profile_device_ms_per_step": 0.5, "profile_syncs_per_step": 3.0}
    figures |= {"profile_sync_sites": sites.by_site(), "profile_table": "", "profile_python": ""}
    assert "   2  hf/sampling.py:88 sample" in profile_report(figures, "step")
