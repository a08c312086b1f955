"""The CacheBlend probe: the first layers of a model over chosen positions, run explicitly.

The probe feeds the positions to compute (gaps, tail) and the loaded approximate tokens through layers
``0..check_layer`` only (the model's depth is cut the way transformers' early-exit assistant cuts it), on a
small cache object that shares those layers with the caller's cache. Fresh K/V are scattered into the shared
layers (as the repair forward would write them) and each position's squared key deviation between the stored
and the fresh key at ``check_layer`` is returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.reuse.repair import position_mask


def scatter_into(layer: CacheLayerMixin, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``keys``/``values`` ``[B, H, len(positions), D]`` into ``layer`` at sequence ``positions``."""
    layer.keys.index_copy_(2, positions, keys.to(layer.keys.dtype))
    layer.values.index_copy_(2, positions, values.to(layer.values.dtype))


class _ProbeCache(Cache):
    """The first ``check_layer + 1`` layers of another cache, written by scatter; records the key deviation."""

    def __init__(self, layers: Sequence[CacheLayerMixin], positions: torch.Tensor) -> None:
        super().__init__(layers=list(layers))
        self.positions = positions
        self.deviation: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer_idx == len(self.layers) - 1:
            stored = layer.keys.index_select(2, self.positions)
            self.deviation = (key_states.float() - stored.float()).pow(2).sum(dim=(0, 1, 3))
        scatter_into(layer, self.positions, key_states, value_states)
        return layer.keys, layer.values


@contextlib.contextmanager
def truncated_depth(model: PreTrainedModel, num_layers: int) -> Iterator[None]:
    """Run only the first ``num_layers`` decoder layers inside the block (as transformers' early exit does)."""
    config = getattr(model, model.base_model_prefix, model).config
    original = config.num_hidden_layers
    config.num_hidden_layers = num_layers
    try:
        yield
    finally:
        config.num_hidden_layers = original


def key_deviation(
    model: PreTrainedModel,
    layers: Sequence[CacheLayerMixin],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    check_layer: int,
) -> torch.Tensor:
    """Squared key deviation ``[len(positions)]`` (CPU, fp32) at ``check_layer`` for tokens ``input_ids[0,
    positions]``; ``layers`` hold the stitched K/V at full prompt length and get fresh K/V at ``positions`` in
    layers ``0..check_layer``."""
    depth = min(check_layer, len(layers) - 1) + 1
    device = layers[0].keys.device
    positions = positions.to(device)
    probe = _ProbeCache(layers[:depth], positions)
    with truncated_depth(model, depth):
        model(
            input_ids=input_ids[:, positions.cpu()].to(device),
            position_ids=positions[None],
            attention_mask=position_mask(positions, input_ids.shape[1], layers[0].keys.dtype),
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_ARGUMENT: probe},
        )
    if probe.deviation is None:
        raise RuntimeError(f"the CacheBlend probe never reached layer {depth - 1} of {type(model).__name__}")
    return probe.deviation.cpu()
