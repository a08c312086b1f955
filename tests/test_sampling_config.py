"""``SamplingConfig`` refuses a setting outside its range, naming it, and takes every setting inside it; a row's
choice survives overflowing scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf import SamplingConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.hf.sampling import build_processors, choose_token

VALID = st.fixed_dictionaries(
    {
        "temperature": st.floats(0, 10),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 1000),
        "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 10, exclude_min=True),
        "logit_bias": st.lists(st.tuples(st.integers(0, 10**6), st.floats(-100, 100)), max_size=3).map(tuple),
        "min_tokens": st.integers(0, 100),
        "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=3).map(tuple),
        "seed": st.none() | st.integers(0, 2**63 - 1),
    }
)

#: (field, a value outside its range) for every field with a range.
OUT_OF_RANGE = [
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("top_k", 2.5),
    ("min_p", 1.01),
    ("presence_penalty", math.inf),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0),
    ("logit_bias", ((-3, 1.0),)),
    ("logit_bias", ((3, math.nan),)),
    ("min_tokens", -1),
    ("stop_token_ids", (2, -7)),
    ("seed", 1.5),
    ("temperature", True),
]


@given(VALID)
def test_every_setting_in_range_is_taken(settings):
    assert SamplingConfig(**settings) == SamplingConfig(**settings)


@given(VALID, st.sampled_from(OUT_OF_RANGE))
def test_one_setting_out_of_range_is_refused_by_name(settings, bad):
    name, value = bad
    with pytest.raises(ConfigError, match=f"{name}="):
        SamplingConfig(**{**settings, name: value})


def test_numpy_numbers_are_numbers():
    config = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(1))
    assert config.top_k == 3 and not config.greedy


def test_openai_shaped_settings_are_kept_as_tuples():
    """A ``{token id: bias}`` dict, lists and None are taken (kept as tuples, hashable); a lone stop id is a tuple."""
    config = SamplingConfig(logit_bias={7: 3.0, 2: -1.0}, stop_token_ids=[4, 5])
    assert config.logit_bias == ((7, 3.0), (2, -1.0)) and config.stop_token_ids == (4, 5)
    assert SamplingConfig(logit_bias=[[7, 3.0]], stop_token_ids=9) == SamplingConfig(
        logit_bias=((7, 3.0),), stop_token_ids=(9,)
    )
    assert SamplingConfig(logit_bias=None, stop_token_ids=None) == SamplingConfig()
    hash(config)
    with pytest.raises(ConfigError, match="logit_bias="):
        SamplingConfig(logit_bias=[5])


def test_overflowing_scores_take_the_softmax_limit_and_nan_is_refused():
    """A repetition penalty near 0 divides positive logits into +inf: the draw is then among those tokens alone
    (it raised inside torch.multinomial and failed every request of the batch); a NaN score is refused by name."""
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0]])
    config = SamplingConfig(repetition_penalty=1e-39, seed=0)
    scores = build_processors(config, prompt_length=3, eos_token_ids=[4])(torch.tensor([[0, 2, 1]]), logits.clone())
    assert scores[0, 0] == scores[0, 2] == math.inf
    generator = torch.Generator().manual_seed(0)
    assert {choose_token(scores, config, generator) for _ in range(40)} == {0, 2}
    assert choose_token(scores, SamplingConfig(temperature=0), generator) == 0
    with pytest.raises(ConfigError, match="NaN score"):
        choose_token(torch.tensor([[1.0, math.nan]]), config, generator)
    with pytest.raises(ConfigError, match="every token is masked"):
        choose_token(torch.full((1, 3), -math.inf), config, generator)


@given(
    st.lists(st.sampled_from(["greedy", "sample", "overflow"]), min_size=1, max_size=5),
    st.integers(0, 2**31),
)
def test_several_rows_choose_at_once_as_each_would_alone(kinds, seed):
    """``choose_tokens`` (one wait on the device for a batch's sampled rows, where each row waited twice) takes,
    row by row, what the one-row rule takes: the argmax of a greedy row, and for a sampled one the draw of its own
    generator from the softmax of its own scores (+inf scores: those tokens alone)."""
    from kvboost_hf.hf.sampling import choose_tokens

    scores = torch.randn(len(kinds), 50, generator=torch.Generator().manual_seed(seed))
    for row, kind in enumerate(kinds):
        if kind == "overflow":
            scores[row, [3, 17]] = math.inf
    params = [SamplingConfig(temperature=0 if kind == "greedy" else 0.8) for kind in kinds]
    got = choose_tokens(scores, params, [torch.Generator().manual_seed(seed + row) for row in range(len(kinds))])
    expected = []
    for row, kind in enumerate(kinds):  # the one-row rule, written out
        one = scores[row]
        if kind == "overflow":
            one = torch.where(one == math.inf, 0.0, -math.inf)
        if kind == "greedy":
            expected.append(int(one.argmax()))
            continue
        generator = torch.Generator().manual_seed(seed + row)
        expected.append(int(torch.multinomial(torch.softmax(one[None], dim=-1)[0], 1, generator=generator)))
    assert got == expected
