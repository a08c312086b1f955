"""``python -m kvboost_hf.bench NAME``: an unknown name and a flag out of range are usage errors, not tracebacks."""

from __future__ import annotations

import pytest

from kvboost_hf.bench.__main__ import main


def test_an_unknown_benchmark_is_a_usage_error(capsys):
    assert main(["nope"]) == 2 and "usage: python -m kvboost_hf.bench" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["streaming", "--random-shape", "tiny", "--dtype", "bogus"], "--dtype must name a floating torch dtype"),
        (["streaming", "--random-shape", "tiny", "--num-slots", "0"], "num_slots must be an integer >= 1"),
    ],
)
def test_a_setting_out_of_range_is_a_usage_error(argv, message, capsys, tmp_path):
    """They were tracebacks (AttributeError for --dtype bogus, ConfigError for --num-slots 0)."""
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"python -m kvboost_hf.bench {argv[0]}: error:" in err and message in err


def test_zero_turns_is_a_usage_error(capsys):
    """It raised IndexError."""
    with pytest.raises(SystemExit) as stopped:
        main(["multiturn", "--random-shape", "tiny", "--turns", "0"])
    assert stopped.value.code == 2 and "--turns must be at least 1" in capsys.readouterr().err
