"""The demo's closing summary (``kvboost_hf.demo.summary``): medians over the turns with something cached."""

from __future__ import annotations

import pytest

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.corpus import chat_script, max_chat_turns
from kvboost_hf.demo import Turn, main, summary
from kvboost_hf.results import GenerationResult


def _result(ttft_ms: float, output_ids: list[int], cached: int = 0, prompt: int = 100) -> GenerationResult:
    return GenerationResult(
        mode="chunk_kv_reuse", prompt="", output_text="", output_ids=output_ids, generated_tokens=len(output_ids),
        ttft_ms=ttft_ms, total_ms=ttft_ms, tokens_per_sec=0.0, kv_reuse_ratio=cached / prompt, prompt_tokens=prompt,
        cached_tokens=cached, finish_reason="length",
    )  # fmt: skip


def test_summary_uses_the_turns_after_the_first_and_counts_identical_outputs():
    turns = [
        Turn(_result(900, [1]), _result(880, [1])),  # turn 1: nothing cached yet, left out of the medians
        Turn(_result(1000, [2]), _result(100, [2], cached=80)),
        Turn(_result(1200, [3]), _result(150, [4], cached=90)),
    ]
    lines = summary(turns)
    assert lines[0] == "TTFT, median of turns 2-3: cold 1100 ms, warm 125 ms (8.8x faster)"
    assert lines[1] == "last turn: 90 of 100 prompt tokens loaded from the store (90%)"
    assert lines[2] == "outputs identical cold vs warm: 2 of 3 turns"


def test_summary_of_a_single_turn_uses_it():
    assert summary([Turn(_result(500, [1]), _result(250, [1]))])[0].startswith("TTFT, median of turn 1: cold 500 ms")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--chunk-size", "0"], "--chunk-size must be at least 1"),
        (["--turns", "0"], "--turns must be at least 1"),
        # it played fewer turns (21 of 30 on Python 3.11), the summary saying "turns 2-21"
        (["--turns", str(max_chat_turns() + 1)], f"--turns must be at most {max_chat_turns()}"),
        (["--stats-json", "/nonexistent-dir/stats.json"], "no directory /nonexistent-dir"),
        (["--stats-json", "/tmp"], "--stats-json must name a file, got the directory /tmp"),
    ],
)
def test_bad_flags_are_usage_errors_before_the_model_loads(flags, message, capsys):
    """They were tracebacks after loading (or, for --stats-json, after the whole run: a directory too)."""
    with pytest.raises(SystemExit) as stopped:
        main(flags)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_chat_script_refuses_more_turns_than_it_has_messages():
    most = max_chat_turns()
    system, messages = chat_script(most)
    assert system and len(set(messages)) == most > 8  # the benchmarks' default turns
    with pytest.raises(ConfigError, match=f"turns must be at most {most}"):
        chat_script(most + 1)
