"""The serve benchmark's join measure, on fabricated chunk times (no server), and the flags its servers get: fast."""

from __future__ import annotations

import argparse
import math

from kvboost_hf.bench import serve
from kvboost_hf.bench.serve import join_gaps


def test_join_gaps_split_steady_gaps_from_those_overlapping_the_join():
    """Two rows at 0.1 s per token, one stalled 2 s by a join sent at 1.05 s whose first token came at 3.0 s: the
    steady median is 100 ms, the worst gap overlapping the join 2,100 ms (the stall and the step around it)."""
    first = [0.1 * i for i in range(11)] + [3.1, 3.2, 3.3]  # 0.0 .. 1.0, then a 2.1 s gap, then steady again
    second = [0.05 + 0.1 * i for i in range(11)] + [3.15, 3.25]
    gaps = join_gaps([first, second], start=1.05, end=3.0)
    assert math.isclose(gaps["median_ms"], 100.0, abs_tol=1e-6)
    assert math.isclose(gaps["worst_ms"], 2100.0, abs_tol=1e-6)
    assert gaps["gaps_during_join"] == 2  # one per row: 1.0 -> 3.1 and 1.05 -> 3.15
    assert math.isclose(gaps["ratio"], 21.0, rel_tol=1e-9)
    assert math.isclose(gaps["joined_ms"], 2100.0, abs_tol=1e-6) and math.isnan(gaps["chunks_worst_ms"])


def test_join_gaps_tell_the_chunk_steps_from_the_step_that_joined():
    """Steps of 0.1 s, 0.3 s while the join is prefilled in chunks (sent at 1.0 s), 0.5 s for the step whose end
    brought its first token (2.0 s): worst 500 ms, from the joining step; chunk steps at most 300 ms."""
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.3, 1.6, 1.9, 2.4, 2.5, 2.6]
    gaps = join_gaps([times], start=1.0, end=2.0)
    assert math.isclose(gaps["median_ms"], 100.0, abs_tol=1e-6)
    assert math.isclose(gaps["chunks_worst_ms"], 300.0, abs_tol=1e-6)
    assert math.isclose(gaps["joined_ms"], 500.0, abs_tol=1e-6) and math.isclose(gaps["worst_ms"], 500.0, abs_tol=1e-6)
    # during: 300, 300, 300, 500; the 90th percentile sits 0.9 x 3 = 2.7 ranks in: 300 + 0.7 x (500 - 300)
    assert math.isclose(gaps["join_p90_ms"], 440.0, abs_tol=1e-6)
    assert math.isclose(gaps["steady_worst_ms"], 100.0, abs_tol=1e-6)


def test_join_gaps_without_gaps_on_a_side_are_nan():
    gaps = join_gaps([[0.0, 0.1]], start=5.0, end=6.0)
    assert gaps["median_ms"] > 0 and math.isnan(gaps["worst_ms"]) and math.isnan(gaps["ratio"])


def test_special_token_bias_bans_the_chat_turn_markers_that_have_no_text():
    """The join's rows stream past their end token: the turn markers would decode to no text (no chunk, a gap of
    two steps at the client), so the bias bans them, and nothing a row may visibly write."""
    from transformers import AutoTokenizer

    from kvboost_hf.bench.serve import special_token_bias
    from kvboost_hf.hf.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    bias = special_token_bias(None)
    markers = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert {str(token) for token in markers} <= set(bias) and set(bias.values()) == {-100}
    for token in map(int, bias):
        assert tokenizer.decode([token], skip_special_tokens=True) == ""
    assert str(tokenizer.convert_tokens_to_ids("Ġthe")) not in bias


def test_the_servers_get_graph_and_attention_flags_only_when_asked():
    parser = argparse.ArgumentParser()
    serve.add_load_arguments(parser, users=2, turns=2)
    default = serve.server_flags(parser.parse_args([]))
    assert not [flag for flag in default if "graphs" in flag or "attn" in flag]
    asked = serve.server_flags(parser.parse_args(["--no-graphs", "--attn-implementation", "kvboost"]))
    assert asked[-3:] == ["--no-graphs", "--attn-implementation", "kvboost"]
