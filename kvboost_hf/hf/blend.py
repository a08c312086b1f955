"""CacheBlend's repair forward: each decoder layer recomputes its own, shrinking set of loaded tokens.

A sparse repair forward computes the positions it is given (gaps, the live tail, chosen repairs) and scatters their
K/V into the stitched cache (:func:`scatter_into`). With CacheBlend the forward starts with every loaded
approximate token as a *candidate*; after a layer has computed fresh K/V, the candidates whose fresh key (or value)
deviates least from the stored one are dropped, so the next layer computes fewer tokens and keeps the stored K/V
of the dropped ones (the paper's gradual filtering; dropping all but the chosen share at one layer is the
one-shot selection of the public CacheBlend and LMCache code).

:class:`LayerFilter` is that state, armed on the cache for one forward: the cache calls :meth:`LayerFilter.observe`
with each layer's fresh K/V before it scatters them, and a forward pre-hook on every decoder layer
(:func:`install_layer_narrowing`) narrows the layer's inputs (hidden states, mask rows, positions, rotary
embeddings) to the tokens still computed. Invariants: positions stay sorted, forced (non-candidate) positions are
never dropped, so the last position (the one giving logits) is computed by every layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvboost_hf.core.errors import ArgumentTypeError, ConfigError
from kvboost_hf.hf.models import given_cache
from kvboost_hf.offload.streamer import decoder_layers


def scatter_into(layer: CacheLayerMixin, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``keys``/``values`` ``[B, H, len(positions), D]`` into ``layer`` at sequence ``positions``."""
    layer.keys.index_copy_(2, positions, keys.to(layer.keys.dtype))
    layer.values.index_copy_(2, positions, values.to(layer.values.dtype))


class LayerFilter:
    """Which positions each layer of one sparse forward computes.

    ``positions`` (sorted columns, on the cache's device) are computed by the current layer; ``candidate[i]`` says
    whether ``positions[i]`` is a loaded approximate token that may still be dropped. ``kept[l]`` is how many
    candidates layer ``l`` computes (non-increasing in ``l``). ``compare`` is ``"key"`` or ``"value"``: which of
    the fresh and stored tensors the squared deviation is taken between. ``on_finish`` receives the positions the
    last layer computed once the forward is recorded.
    """

    def __init__(
        self,
        positions: torch.Tensor,
        candidate: torch.Tensor,
        kept: Sequence[int],
        compare: str,
        on_finish: Callable[[torch.Tensor], None],
    ) -> None:
        if compare not in ("key", "value"):
            raise ConfigError(f"CacheBlend compares 'key' or 'value' deviation, got {compare!r}")
        self.positions = positions
        self.candidate = candidate.to(positions.device)
        self.kept = list(kept)
        self.compare = compare
        self.on_finish = on_finish
        self._narrow_to: torch.Tensor | None = None  # indices into positions the next layer keeps
        self._selected: torch.Tensor | None = None  # indices into the forward's tokens this layer computes

    def restrict(self, keep: torch.Tensor) -> None:
        """Compute only ``positions[keep]`` (a bool mask) from the first layer on."""
        self.positions, self.candidate = self.positions[keep], self.candidate[keep]
        self._selected = None

    def observe(self, layer_idx: int, layer: CacheLayerMixin, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer ``layer_idx`` computed ``keys``/``values`` for ``positions`` (``layer`` still holds the stored
        ones): choose what the next layer computes."""
        if layer_idx + 1 >= len(self.kept) or self.kept[layer_idx + 1] >= self.kept[layer_idx]:
            return  # the next layer keeps every candidate this one computed (no device sync to find out)
        fresh, stored = (keys, layer.keys) if self.compare == "key" else (values, layer.values)
        deviation = (fresh.float() - stored.index_select(2, self.positions).float()).pow(2).sum(dim=(0, 1, 3))
        candidates = self.candidate.nonzero().squeeze(1)
        best = torch.topk(deviation[candidates], self.kept[layer_idx + 1]).indices
        keep = ~self.candidate
        keep[candidates[best]] = True
        self._narrow_to = keep.nonzero().squeeze(1)

    def next_layer(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """For the layer about to run: the indices into the previous layer's tokens it keeps (None: all) and the
        indices into the forward's own tokens it computes (None: all). The model hands every layer the same
        per-token inputs (mask, positions, rotary embeddings), so those are narrowed by the second."""
        step, self._narrow_to = self._narrow_to, None
        if step is not None:
            self.positions, self.candidate = self.positions[step], self.candidate[step]
            self._selected = step if self._selected is None else self._selected[step]
        return step, self._selected

    def finish(self) -> None:
        self.on_finish(self.positions)


def _narrow(value: Any, index: torch.Tensor, dim: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(dim, index.to(value.device))
    if isinstance(value, tuple):  # rotary (cos, sin), each [B, q, D]
        return tuple(_narrow(part, index, dim) for part in value)
    raise ArgumentTypeError(f"CacheBlend cannot narrow a decoder layer input of type {type(value).__name__}")


_SEQUENCE_DIM = {"attention_mask": -2, "position_ids": -1, "position_embeddings": -2, "cache_position": 0}
"""Decoder-layer keyword inputs with one entry per computed token, and the dimension it is in."""


def _narrow_layer_inputs(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    cache = given_cache(kwargs)
    layer_filter = getattr(cache, "layer_filter", None)
    if layer_filter is None:
        return None
    step, selected = layer_filter.next_layer()
    if step is not None:
        if args:
            args = (_narrow(args[0], step, 1), *args[1:])
        else:
            kwargs["hidden_states"] = _narrow(kwargs["hidden_states"], step, 1)
    if selected is not None:
        for name, dim in _SEQUENCE_DIM.items():
            if kwargs.get(name) is not None:
                kwargs[name] = _narrow(kwargs[name], selected, dim)
    return args, kwargs


_NARROWING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def install_layer_narrowing(model: torch.nn.Module) -> None:
    """Attach the narrowing pre-hook to every decoder layer of ``model`` (once; a no-op unless a cache passed to
    the forward has an armed :class:`LayerFilter`)."""
    if model in _NARROWING:
        return
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(_narrow_layer_inputs, with_kwargs=True)
    _NARROWING.add(model)
