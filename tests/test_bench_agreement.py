"""Exactness in the benchmarks as pairwise agreement: where two greedy outputs first differ, with plain
``generate()`` run twice as the noise floor (issue 31: one ``same`` flag hid which method differed)."""

from __future__ import annotations

import dataclasses
import json

from kvboost_hf.bench import multiturn
from kvboost_hf.bench.common import agreement_label, earliest_difference, first_difference
from kvboost_hf.engine import InferenceEngine


def test_first_difference_and_its_label():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ended early: they differ where it stopped
    assert first_difference([], []) is None
    assert earliest_difference([None, 4, 2]) == 2 and earliest_difference([None, None]) is None
    assert agreement_label(None) == "=" and agreement_label(3) == "@3"


def test_multiturn_names_the_pair_that_differs_and_where(monkeypatch):
    """kvboost's output altered at token 2 of turn 2 only: the kvboost pairs say @2 on that turn, plain generate
    against itself and against the recipe stay identical, and the report prints it."""
    original = InferenceEngine.generate
    calls = {"kvboost": 0}

    def altered(self, prompt, *args, **kwargs):
        result = original(self, prompt, *args, **kwargs)
        if kwargs.get("mode") is None and isinstance(prompt, list):  # the kvboost method of a turn
            calls["kvboost"] += 1
            if calls["kvboost"] == 2:
                ids = list(result.output_ids)
                ids[2] = ids[2] + 1
                return dataclasses.replace(result, output_ids=ids)
        return result

    monkeypatch.setattr(InferenceEngine, "generate", altered)
    result = multiturn.run(turns=3, max_new_tokens=4, chunk_size=16, repeats=1, random_shape="tiny", dtype="float32")
    first, second, third = (row["first_difference"] for row in result["turns"])
    assert all(index is None for index in first.values()) and all(index is None for index in third.values())
    assert second == {
        "baseline_vs_baseline_repeat": None,
        "baseline_vs_hf_prompt_cache": None,
        "baseline_vs_kvboost": 2,
        "hf_prompt_cache_vs_kvboost": 2,
        "baseline_vs_hf_static": None,  # transformers' StaticCache: plain generate()'s tokens (fp32)
    }
    assert result["identical_turns"]["baseline_vs_kvboost"] == 2
    assert (
        result["identical_turns"]["baseline_vs_baseline_repeat"]
        == result["identical_turns"]["baseline_vs_hf_static"]
        == 3
    )
    assert result["dtype"] == "float32" and result["weights"] == "random"
    line = multiturn.report(result).splitlines()[3]  # title, header, turn 1, turn 2
    assert line.split()[-5:] == ["=", "=", "@2", "@2", "="]


def test_multiturn_graphed_arm_prefills_the_warm_turn_graphed_with_plain_generates_tokens():
    """``--graphs on`` off CUDA (traced, no code generation): an untimed conversation compiles first, then the warm
    turn's prompt forward of its new tokens runs graphed (``pf`` g) with plain generate()'s tokens (fp32). Its
    ~1,020-token prompt plus 12 new tokens passes 1,024: a 2,048-token capacity, where its padded tail fits (in a
    1,024 one, ~900 reused tokens plus 128 padded queries would not: that prefill would run eagerly)."""
    result = multiturn.run(
        turns=2, max_new_tokens=12, chunk_size=16, repeats=1, random_shape="tiny", dtype="float32", graphs=True
    )
    first, second = result["turns"]
    assert not first["kvboost_prefill_graphed"] and second["kvboost_prefill_graphed"]  # turn 1 reuses nothing
    assert second["kvboost_cached_tokens"] > 0 and all(row["outputs_identical"] for row in result["turns"])
    assert result["graph_compile_pass_s"] > 0 and result["graph_stats"]["failed_shapes"] == 0
    assert [line.split()[5] for line in multiturn.report(result).splitlines()[2:4]] == ["e", "g"]


def test_multiturn_runs_only_the_methods_asked_for_and_compares_only_their_pairs(tmp_path):
    """``--methods baseline,kvboost`` (a GPU run leaves out hf_static, which compiles a graph per turn): the other
    methods are neither timed nor compared, the report shows ``-`` for them, and a missing required or unknown
    method is refused by name. ``--profile-turn`` profiles that turn's request once more (a turn past
    ``--turns`` refused)."""
    multiturn.main(
        [
            "--random-shape",
            "tiny",
            "--turns",
            "2",
            "--max-new-tokens",
            "3",
            "--repeats",
            "1",
            "--chunk-size",
            "16",
            "--dtype",
            "float32",
            "--methods",
            "kvboost,baseline",
            "--profile-turn",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    result = json.loads((tmp_path / "multiturn.json").read_text())
    profile = result["profile"]  # the warm turn's request again, one token, under both profilers
    assert profile["turn"] == 2 and profile["ttft_ms"] > 0 and profile["profile_syncs_per_step"] == 0  # CPU
    assert "Self CPU" in profile["profile_table"] and "engine.py" in profile["profile_python"]
    phases = profile["phases"]  # the same request by phase, in a replay of its own: the reused K/V copied in
    assert phases["tokenize"] > 0 and phases["copy_into_cache"] > 0 and phases["forward"] > 0 and phases["ttft"] > 0
    assert "kvboost at turn 2, one token, by phase (ms): tokenize" in multiturn.report(result)
    collections = result["turns"][1]["kvboost_gc"][0]  # the garbage collections inside its timed request
    assert len(collections["collections"]) == len(collections["ms"]) == 3
    assert "garbage collections inside kvboost's requests:" in multiturn.report(result)
    assert result["methods"] == ["baseline", "kvboost"]
    turn = result["turns"][1]
    assert "hf_static_ttft_ms" not in turn and "hf_prompt_cache_ttft_ms" not in turn
    assert set(turn["first_difference"]) == {"baseline_vs_baseline_repeat", "baseline_vs_kvboost"}
    assert turn["first_difference"]["baseline_vs_kvboost"] is None  # fp32: kvboost gives plain generate()'s tokens
    fields = multiturn.report(result).splitlines()[3].split()  # title, header, turn 1, turn 2
    assert [fields[7], fields[9], fields[11]] == ["-", "-", "-"]  # the recipe's and static's TTFT, kvboost vs hf
    assert fields[-5:] == ["=", "-", "=", "-", "-"]
    for bad in (["--methods", "baseline,hf_static"], ["--methods", "baseline,kvboost,bogus"], ["--profile-turn", "9"]):
        try:
            multiturn.main(["--random-shape", "tiny", *bad, "--out", str(tmp_path)])
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")
