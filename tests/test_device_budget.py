"""The device budget planner (a pure function of byte counts) and byte-size parsing."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.offload import BudgetTooSmallError, parse_bytes, plan_device_memory

MB = 10**6


def need(layers: list[int], resident: int, slots: int, fixed: int) -> int:
    """Bytes of a plan with ``resident`` leading layers and ``slots`` slots, written out independently."""
    streamed = layers[resident:]
    return fixed + sum(layers[:resident]) + (slots * max(streamed) if streamed else 0)


problems = st.fixed_dictionaries(
    {
        "budget": st.integers(1, 20_000),
        "layers": st.lists(st.integers(1, 400), min_size=1, max_size=40),
        "other": st.integers(0, 3_000),
        "workspace": st.integers(0, 1_000),
        "per_token": st.integers(1, 50),
        "min_tokens": st.integers(0, 100),
        "slots": st.integers(1, 3),
    }
)


@given(problems)
def test_the_plan_fits_keeps_the_most_layers_and_gives_the_rest_to_kv(p):
    fixed = p["other"] + p["workspace"] + p["min_tokens"] * p["per_token"]
    layers = p["layers"]
    try:
        plan = plan_device_memory(
            p["budget"], layers, p["other"], kv_bytes_per_token=p["per_token"], min_kv_tokens=p["min_tokens"],
            workspace_bytes=p["workspace"], num_slots=p["slots"],
        )  # fmt: skip
    except BudgetTooSmallError:
        assert all(need(layers, r, 1, fixed) > p["budget"] for r in range(len(layers) + 1))
        return
    assert plan.resident_layers + plan.streamed_layers == len(layers)
    assert plan.used_bytes <= plan.budget_bytes == p["budget"]
    assert plan.kv_tokens >= p["min_tokens"] and plan.kv_bytes == plan.kv_tokens * p["per_token"]
    assert plan.budget_bytes - plan.used_bytes < p["per_token"]  # every whole token's worth left goes to K/V
    assert plan.streamed_bytes_per_forward == sum(layers[plan.resident_layers :])
    if plan.streamed_layers == 0:
        assert plan.num_slots == 0 and plan.slot_bytes == 0
        return
    assert need(layers, len(layers), 0, fixed) > p["budget"]  # all resident did not fit
    assert 1 <= plan.num_slots <= p["slots"]
    assert plan.slot_bytes == plan.num_slots * max(layers[plan.resident_layers :])
    # no plan with more resident layers fits with these slots, and more slots fit with no layer count at all
    assert all(
        need(layers, r, plan.num_slots, fixed) > p["budget"] for r in range(plan.resident_layers + 1, len(layers))
    )
    for more in range(plan.num_slots + 1, p["slots"] + 1):
        assert all(need(layers, r, more, fixed) > p["budget"] for r in range(len(layers)))
    config = plan.streaming_config(device="cpu")
    assert config.keep_first_k == plan.resident_layers and config.num_slots == plan.num_slots


def test_a_32b_int4_shape_in_12_gb():
    """Qwen2.5-32B in AWQ int4 (group 128): 64 layers of ~253 MB, 3.1 GB of embeddings and head, 256 KiB of bf16
    K/V per token, 1 GB of workspace: 5.19 GB fixed + 2 slots (0.51 GB) leave 6.31 GB: 24 layers resident, 40
    streamed (10.1 GB per forward)."""
    plan = plan_device_memory(
        parse_bytes("12GB"), [253 * MB] * 64, 3114 * MB, kv_bytes_per_token=262_144, min_kv_tokens=4096,
        workspace_bytes=1000 * MB,
    )  # fmt: skip
    assert (plan.resident_layers, plan.num_slots) == (24, 2) and plan.kv_tokens >= 4096
    assert plan.streamed_bytes_per_forward == 40 * 253 * MB and plan.used_bytes <= 12e9


def test_bad_arguments_and_byte_sizes():
    with pytest.raises(BudgetTooSmallError, match="cannot hold"):
        plan_device_memory(100, [60, 60], 50, kv_bytes_per_token=1, min_kv_tokens=0)
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1"):
        plan_device_memory(100, [10], 0, kv_bytes_per_token=1, min_kv_tokens=0, num_slots=0)
    assert parse_bytes("12GB") == 12 * 10**9 and parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("512 MB") == 512 * MB and parse_bytes("1e9") == 10**9 and parse_bytes("77") == 77
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("twelve gigs")


def test_a_byte_size_beyond_a_float_is_a_config_error():
    """``1e400`` overflowed in ``int(inf)`` (``bench streaming --device-budget 1e400`` printed a traceback)."""
    with pytest.raises(ConfigError, match="not a byte size: '1e400'"):
        parse_bytes("1e400")


GOOD_PLAN = {"budget_bytes": 10**9, "layer_bytes": [10**8] * 4, "other_bytes": 0, "kv_bytes_per_token": 1000,
             "min_kv_tokens": 10, "workspace_bytes": 0, "num_slots": 2}  # fmt: skip
NOT_A_COUNT = st.one_of(
    st.integers(max_value=-1), st.floats(0.1, 1e12).filter(lambda f: f != int(f)), st.just(True), st.just("1GB")
)


@given(name=st.sampled_from(sorted(GOOD_PLAN)), bad=NOT_A_COUNT)
def test_every_count_of_the_plan_is_checked_by_name(name, bad):
    """Negative workspace or other bytes let 4 GB of layers "fit" 1 GB, fractional bytes per token gave fractional
    plans, ``num_slots=2.5`` raised TypeError: each count is an integer at least its least value."""
    arguments = dict(GOOD_PLAN)
    arguments[name] = [10**8, bad] if name == "layer_bytes" else bad
    budget, layers, other = (arguments.pop(key) for key in ("budget_bytes", "layer_bytes", "other_bytes"))
    label = "layer_bytes[1]" if name == "layer_bytes" else name
    with pytest.raises(ConfigError, match=re.escape(f"plan_device_memory: {label} must be an integer >=")):
        plan_device_memory(budget, layers, other, **arguments)
