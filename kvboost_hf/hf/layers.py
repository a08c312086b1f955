"""Stage 6a: the per-layer K/V containers of a :class:`~kvboost_hf.hf.cache.ChunkReuseCache`.

:class:`ChunkReuseLayer` (full attention) and :class:`ChunkReuseSlidingLayer` (sliding window) are
``transformers`` cache layers whose K/V live in buffers with spare capacity, written in place: stitched chunks are
copied once into their final columns, and a decode step copies only its own tokens' K/V. :func:`cache_layers`
builds one per decoder layer of a model.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

__all__ = ["ChunkReuseLayer", "ChunkReuseSlidingLayer", "cache_layers", "grown_capacity"]


GROWTH_MIN_TOKENS = 256
"""Fewest columns (tokens) a layer's buffer grows by."""
GROWTH_DIVISOR = 8
"""A buffer grows by at least ``capacity // GROWTH_DIVISOR`` columns: at most 12.5% spare memory, and a decode step
copies ``GROWTH_DIVISOR`` tokens' K/V amortized (the held columns once per growth)."""


def grown_capacity(needed: int, capacity: int = 0) -> int:
    """Columns (tokens) to allocate for ``needed`` columns when ``capacity`` are held: ``needed`` plus room to
    grow by ``max(GROWTH_MIN_TOKENS, capacity // GROWTH_DIVISOR)``, rounded up to a multiple of 64."""
    wanted = max(needed, capacity) + max(GROWTH_MIN_TOKENS, max(needed, capacity) // GROWTH_DIVISOR)
    return -(-wanted // 64) * 64


class ChunkReuseLayer(DynamicLayer):
    """A full-attention layer whose K/V are written in place into buffers with spare capacity.

    ``keys``/``values`` are ``[B, H_kv, length, D]`` views of ``[B, H_kv, capacity, D]`` buffers, so a decode step
    copies only its own tokens' K/V (amortized; growth copies the held columns once, see :func:`grown_capacity`),
    where ``DynamicLayer`` concatenates the whole context every step.

    Invariants: columns ``[0, length)`` of the buffers hold the layer's K/V. The layer writes in place only into
    buffers it allocated itself (``owned``): a tensor handed to it (assigned to ``keys``/``values``, adopted, or
    the model's K/V of a first forward) is held as is and never modified, so stored entries and caller tensors stay
    intact; the first write past such a tensor's length moves the columns into an owned buffer. Assigning
    ``keys`` and ``values`` (crop, batch selection, joins do) replaces the buffers, like ``DynamicLayer``.
    """

    def __init__(self) -> None:
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0  # columns of keys (the layer's length)
        self._value_length = 0  # columns of values: equal to _length except between two assignments
        self.owned = False
        super().__init__()

    @property
    def keys(self) -> torch.Tensor:  # None before initialization, as in DynamicLayer
        return _leading_columns(self._key_buffer, self._length)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._key_buffer, self.owned = tensor, False
        self._length = _columns(tensor)

    @property
    def values(self) -> torch.Tensor:  # None before initialization, as in DynamicLayer
        return _leading_columns(self._value_buffer, self._value_length)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._value_buffer, self.owned = tensor, False
        self._value_length = _columns(tensor)

    @property
    def capacity(self) -> int:
        """Columns the buffers hold room for (``length`` for a handed tensor)."""
        return _columns(self._key_buffer)

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self._length == 0:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        start, end = self._length, self._length + key_states.shape[-2]
        self.reserve(end)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self._length = self._value_length = end
        return self.keys, self.values

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns in owned buffers (copying the held ones once when it must grow)."""
        if self.owned and self.capacity >= columns:
            return
        held_keys, held_values = self.keys, self.values
        batch, heads, length, _ = held_keys.shape
        capacity = grown_capacity(columns, self.capacity)
        keys = held_keys.new_empty(batch, heads, capacity, held_keys.shape[-1])
        values = held_values.new_empty(batch, heads, capacity, held_values.shape[-1])
        keys[:, :, :length].copy_(held_keys)
        values[:, :, :length].copy_(held_values)
        self.take_buffers(keys, values, length)

    def take_buffers(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Hold the owned buffers ``keys``/``values`` (``[B, H_kv, capacity, D]``, written in place from now on),
        whose first ``length`` columns are this layer's K/V."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer, self.owned = keys, values, True
        self._length = self._value_length = length

    def set_length(self, length: int) -> None:
        """Declare the first ``length`` columns of the buffers (written in place by the caller) the layer's K/V."""
        if length > self.capacity:
            raise ValueError(f"length {length} exceeds the layer's capacity of {self.capacity} columns")
        self._length = self._value_length = length

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop`` (a negative count), keeping the buffers: the freed columns are reused."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._length = self._value_length = max(self._length + tokens_to_remove, 0)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys``/``values`` (a full-length stitched buffer)."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values


def _columns(tensor: torch.Tensor | None) -> int:
    return int(tensor.shape[-2]) if tensor is not None and tensor.dim() == 4 else 0


def _leading_columns(buffer: torch.Tensor | None, length: int) -> torch.Tensor:
    if buffer is None:
        return None  # type: ignore[return-value]  # an uninitialized layer, as DynamicLayer's
    if buffer.dim() != 4 or buffer.shape[-2] == length:
        return buffer
    return buffer[:, :, :length]


class ChunkReuseSlidingLayer(ChunkReuseLayer):
    """A sliding-window layer that keeps every column but shows attention only the window.

    ``keys``/``values`` hold all ``[B, H, columns, D]`` columns, like :class:`ChunkReuseLayer`, so chunks can be
    written back after they slid out of the window. :meth:`update` returns, and :meth:`get_mask_sizes` announces,
    what ``DynamicSlidingWindowLayer`` does: the last ``min(past, sliding_window - 1)`` past columns followed by
    the new ones, the mask's ``kv_offset`` being the index of the first of them.
    """

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        past = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        visible = min(past, self.sliding_window - 1) + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        past = self.get_seq_length()
        return min(past, self.sliding_window - 1) + query_length, max(past - self.sliding_window + 1, 0)


def cache_layers(model: PreTrainedModel) -> list[ChunkReuseLayer]:
    """One layer per decoder layer of ``model``, following its ``layer_types`` as ``DynamicCache(config=...)`` does.

    Raises ``ValueError`` for layer kinds chunk reuse does not handle (chunked attention, linear attention, shared
    or attention-free layers), naming them.
    """
    layer_types, layer_kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    layers: list[ChunkReuseLayer] = []
    for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        if kind == "full_attention":
            layers.append(ChunkReuseLayer())
        elif kind == "sliding_attention":
            layers.append(ChunkReuseSlidingLayer(int(kwargs["sliding_window"])))
        else:
            raise ValueError(
                f"ChunkReuseCache supports full and sliding-window attention layers; layer {index} of "
                f"{type(model).__name__} is {kind!r}"
            )
    return layers
