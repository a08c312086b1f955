"""Fit a model into a device memory budget: how many decoder layers stay resident, how many slots stream the rest,
and how many tokens of K/V the remainder holds (a pure function of byte counts: :func:`plan_device_memory`).

Accounting (bytes): ``other`` (embeddings, final norm, ``lm_head``: always resident) + the first ``resident_layers``
decoder layers + ``num_slots`` x the largest streamed layer + ``workspace`` (activations, logits, a prefill's
dequantized weight, the CUDA context: the caller's estimate) + K/V (``kv_tokens`` x bytes per token) <= budget.
Layer sizes are the streamer's (:func:`~kvboost_hf.offload.streamer.layer_device_bytes`, alignment included).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_hf.core.errors import CapacityError, ConfigError
from kvboost_hf.core.values import is_integer
from kvboost_hf.offload.settings import LayerStreamingConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class BudgetTooSmallError(CapacityError):
    """The budget cannot hold even the smallest plan (everything but the layers, one slot, the minimum K/V)."""


def parse_bytes(text: str) -> int:
    """``"12GB"`` (10^9), ``"12GiB"`` (2^30), ``"512MB"``, ``"1e9"`` or a plain integer, to bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ConfigError(f"not a byte size: {text!r} (examples: 12GB, 12GiB, 512MB)")
    size = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(size):
        raise ConfigError(f"not a byte size: {text!r} is beyond a float (examples: 12GB, 12GiB, 512MB)")
    return int(size)


@dataclass(frozen=True)
class DevicePlan:
    """Where a model's bytes go on the device (all sizes in bytes; see the module docstring)."""

    budget_bytes: int
    resident_layers: int  # the first decoder layers, kept on the device
    streamed_layers: int  # the rest, copied in on every forward
    num_slots: int  # 0 when nothing streams
    other_bytes: int
    resident_layer_bytes: int
    slot_bytes: int  # num_slots x the largest streamed layer
    workspace_bytes: int
    kv_tokens: int  # tokens of K/V the plan leaves room for
    kv_bytes: int  # kv_tokens x bytes per token
    streamed_bytes_per_forward: int  # what one forward copies host to device (each streamed layer once)

    @property
    def used_bytes(self) -> int:
        return self.other_bytes + self.resident_layer_bytes + self.slot_bytes + self.workspace_bytes + self.kv_bytes

    def streaming_config(self, **settings: Any) -> LayerStreamingConfig:
        """The :class:`LayerStreamingConfig` of this plan (``settings``: its other fields, e.g. ``device``)."""
        return LayerStreamingConfig(keep_first_k=self.resident_layers, num_slots=max(self.num_slots, 1), **settings)


def plan_device_memory(
    budget_bytes: int,
    layer_bytes: Sequence[int],
    other_bytes: int,
    *,
    kv_bytes_per_token: int,
    min_kv_tokens: int,
    workspace_bytes: int = 0,
    num_slots: int = LayerStreamingConfig.num_slots,
) -> DevicePlan:
    """The plan that keeps the most leading layers resident with ``num_slots`` slots (fewer slots, down to 1, only if
    ``num_slots`` cannot fit at all), at least ``min_kv_tokens`` of K/V, and gives every byte left over to K/V.

    All layers resident (no slot) when they fit. Every argument is an integer (bytes, tokens or slots); raises
    :class:`ConfigError` naming one that is not, or is below its least value (budget, bytes per token and slots
    >= 1, the rest >= 0; at least one layer), and :class:`BudgetTooSmallError` when no plan fits.
    """
    layers = list(layer_bytes)
    if not layers:
        raise ConfigError("plan_device_memory: layer_bytes must name at least one layer")
    counts = [
        ("budget_bytes", budget_bytes, 1), ("kv_bytes_per_token", kv_bytes_per_token, 1), ("num_slots", num_slots, 1),
        ("other_bytes", other_bytes, 0), ("workspace_bytes", workspace_bytes, 0), ("min_kv_tokens", min_kv_tokens, 0),
        *((f"layer_bytes[{index}]", size, 0) for index, size in enumerate(layers)),
    ]  # fmt: skip
    for name, value, least in counts:
        if not (is_integer(value) and value >= least):
            raise ConfigError(f"plan_device_memory: {name} must be an integer >= {least}, got {value!r}")
    fixed = other_bytes + workspace_bytes + min_kv_tokens * kv_bytes_per_token

    def plan(resident: int, slots: int) -> DevicePlan:
        streamed = layers[resident:]
        slot_bytes = slots * max(streamed, default=0)
        used = other_bytes + sum(layers[:resident]) + slot_bytes + workspace_bytes
        kv_tokens = max(budget_bytes - used, 0) // kv_bytes_per_token
        return DevicePlan(
            budget_bytes, resident, len(streamed), slots if streamed else 0, other_bytes, sum(layers[:resident]),
            slot_bytes, workspace_bytes, kv_tokens, kv_tokens * kv_bytes_per_token, sum(streamed),
        )  # fmt: skip

    if fixed + sum(layers) <= budget_bytes:
        return plan(len(layers), 0)
    for slots in range(num_slots, 0, -1):
        fitting = [r for r in range(len(layers)) if fixed + sum(layers[:r]) + slots * max(layers[r:]) <= budget_bytes]
        if fitting:
            return plan(max(fitting), slots)
    smallest = fixed + max(layers)
    raise BudgetTooSmallError(
        f"a device budget of {budget_bytes / 1e9:.2f} GB cannot hold the model's resident parts "
        f"({other_bytes / 1e9:.2f} GB), the workspace ({workspace_bytes / 1e9:.2f} GB), {min_kv_tokens} tokens of "
        f"K/V and one slot of the largest layer: {smallest / 1e9:.2f} GB needed"
    )
