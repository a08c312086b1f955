"""Stage 6a: the per-layer K/V containers of a :class:`~kvboost_hf.hf.cache.ChunkReuseCache`.

:class:`ChunkReuseLayer` (full attention) and :class:`ChunkReuseSlidingLayer` (sliding window) are
``transformers`` cache layers whose K/V live in buffers with spare capacity, written in place: stitched chunks are
copied once into their final columns, and a decode step copies only its own tokens' K/V. :func:`cache_layers`
builds one per decoder layer of a model.

Static mode (``max_cache_len`` set; ``ChunkReuseCache(..., max_cache_len=N)``): the buffers are
``[B, H_kv, max_cache_len, D]`` from the first write on, at a fixed address, zero beyond the written columns; the
length lives in a device tensor as well as on the host; :meth:`ChunkReuseLayer.update` writes at the device length
and returns the whole buffers, and ``get_mask_sizes`` announces ``(max_cache_len, 0)``, so transformers' masks cover
the capacity and hide the unwritten columns (they lie after the queries). A decode step then has the same shapes at
every length: ``torch.compile`` and CUDA graphs capture it once (``is_compileable``), as with ``StaticCache``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from kvboost_hf.core.errors import CapacityError, ConfigError, InputError, UnsupportedModelError

__all__ = ["CacheCapacityError", "ChunkReuseLayer", "ChunkReuseSlidingLayer", "cache_layers", "grown_capacity"]


GROWTH_MIN_TOKENS = 256
"""Fewest columns (tokens) a layer's buffer grows by."""
GROWTH_DIVISOR = 8
"""A buffer grows by at least ``capacity // GROWTH_DIVISOR`` columns: above ``GROWTH_MIN_TOKENS * GROWTH_DIVISOR``
held columns the spare is 12.5% of them plus the rounding to 64 (below, ``GROWTH_MIN_TOKENS`` plus the rounding), and
a decode step copies ``GROWTH_DIVISOR`` tokens' K/V amortized (the held columns once per growth)."""


def grown_capacity(needed: int, capacity: int = 0) -> int:
    """Columns (tokens) to allocate for ``needed`` columns when ``capacity`` are held: ``needed`` plus room to
    grow by ``max(GROWTH_MIN_TOKENS, capacity // GROWTH_DIVISOR)``, rounded up to a multiple of 64."""
    wanted = max(needed, capacity) + max(GROWTH_MIN_TOKENS, max(needed, capacity) // GROWTH_DIVISOR)
    return -(-wanted // 64) * 64


class CacheCapacityError(CapacityError):
    """A static-mode cache was asked to hold more tokens than its ``max_cache_len``."""


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

    With ``max_cache_len`` (static mode, see the module doc) every tensor handed to the layer is copied into its
    static buffers instead (reused while the batch shape holds, so their address stays fixed), ``update`` writes at
    the device length with ``index_copy_`` and returns the whole buffers, and more than ``max_cache_len`` columns
    raise :class:`CacheCapacityError`. ``keys``/``values`` still show the written columns only, so crops, joins,
    row selection and write-back see what they see in the default mode.
    """

    def __init__(self, max_cache_len: int | None = None) -> None:
        if max_cache_len is not None and max_cache_len < 1:
            raise ConfigError(f"max_cache_len must be a positive number of tokens, got {max_cache_len}")
        self.max_cache_len = max_cache_len
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0  # columns of keys (the layer's length)
        self._value_length = 0  # columns of values: equal to _length except between two assignments
        self._unrecorded = 0  # static mode: columns written by update() not yet added to _length (see settle)
        self._device_length: torch.Tensor | None = None  # static mode: _length as a device scalar (int64)
        self.owned = False
        super().__init__()

    @property
    def is_compileable(self) -> bool:  # a class attribute in transformers
        """True in static mode: every update has the same shapes, and the length is a device tensor."""
        return self.max_cache_len is not None

    @property
    def keys(self) -> torch.Tensor:  # None before initialization, as in DynamicLayer
        self.settle()
        return _leading_columns(self._key_buffer, self._length)

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self.settle()
        if self.max_cache_len is not None and tensor is not None and tensor.dim() == 4:
            self._key_buffer = self._static_copy(self._key_buffer, tensor)
            self._length = tensor.shape[-2]
            assert self._device_length is not None
            self._device_length.fill_(self._length)
            return
        self._key_buffer, self.owned = tensor, False
        self._length = _columns(tensor)

    @property
    def values(self) -> torch.Tensor:  # None before initialization, as in DynamicLayer
        self.settle()
        return _leading_columns(self._value_buffer, self._value_length)

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self.settle()
        if self.max_cache_len is not None and tensor is not None and tensor.dim() == 4:
            self._value_buffer = self._static_copy(self._value_buffer, tensor)
            self._value_length = _columns(tensor)
            return
        self._value_buffer, self.owned = tensor, False
        self._value_length = _columns(tensor)

    @property
    def capacity(self) -> int:
        """Columns the buffers hold room for (``length`` for a handed tensor; ``max_cache_len`` in static mode)."""
        return self.max_cache_len if self.max_cache_len is not None else _columns(self._key_buffer)

    def get_seq_length(self) -> int:
        if torch.compiler.is_compiling() and self.max_cache_len is not None and self._device_length is not None:
            return self._device_length  # type: ignore[return-value]  # a tensor, as StaticLayer's: no recompiles
        self.settle()
        return self._length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.max_cache_len is not None:
            return self.max_cache_len, 0
        return super().get_mask_sizes(query_length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # an inference cache: no gradient flows through its K/V (a forward outside no_grad wrote into buffers that
        # are views made under no_grad by the prefill, which autograd refuses)
        key_states, value_states = key_states.detach(), value_states.detach()
        if self.max_cache_len is not None:
            return self._static_update(key_states, value_states)
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

    def _static_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Static mode's ``update``: write the new columns at the device length, return the whole buffers.

        Traced by ``torch.compile`` as is: no Python branch reads a tensor or the host length (the capacity check
        runs eagerly only), and the host length catches up on the next eager access (``_unrecorded``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            self.settle()
            if self._length + new > self.capacity:
                raise CacheCapacityError(
                    f"the cache holds {self._length} tokens and cannot take {new} more: its max_cache_len is "
                    f"{self.capacity}; build the ChunkReuseCache with a larger max_cache_len"
                )
            if not self.owned or self._length == 0:  # into the static buffers; empty: take the new batch shape
                held = self._length > 0
                self.keys = self.keys if held else key_states[:, :, :0]
                self.values = self.values if held else value_states[:, :, :0]
        assert self._key_buffer is not None and self._value_buffer is not None and self._device_length is not None
        positions = self._device_length + torch.arange(new, device=self._device_length.device)
        self._key_buffer.index_copy_(2, positions, key_states.to(self._key_buffer.dtype))
        self._value_buffer.index_copy_(2, positions, value_states.to(self._value_buffer.dtype))
        self._device_length.add_(new)
        if torch.compiler.is_compiling():
            self._unrecorded += new  # reading _length here would specialize the graph on it
        else:
            self._length = self._value_length = self._length + new
        return self._key_buffer, self._value_buffer

    def set_max_cache_len(
        self,
        max_cache_len: int | None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
        device_length: torch.Tensor | None = None,
        clear: bool = True,
    ) -> None:
        """Switch mode keeping the held columns: a number makes the layer static with that capacity (the columns
        copied into static buffers at a fixed address: ``buffers``, keys and values ``[B, H_kv, max_cache_len, D]``
        that nothing else uses, e.g. a :class:`~kvboost_hf.hf.static_buffers.StaticBufferPool`'s, their columns
        past the held ones zeroed; else fresh zero buffers; ``device_length``, an int64 scalar on their device that
        nothing else uses, holds the length there, else a fresh one; ``clear=False``: the caller zeroes ``buffers``'
        columns past the held ones itself, for many layers at once); None makes it grow again, writing on in the
        buffers it holds."""
        self.settle()
        if max_cache_len == self.max_cache_len:
            return
        if max_cache_len is not None and max_cache_len < max(self._length, 1):
            raise CacheCapacityError(
                f"cannot hold the layer's {self._length} tokens in a max_cache_len of {max_cache_len}"
            )
        if device_length is not None:
            self._device_length = device_length  # filled when the held columns are set (here or at the first update)
        keys, values = self.keys, self.values
        self.max_cache_len = max_cache_len
        if max_cache_len is not None and keys is not None and keys.dim() == 4:
            # the setters copy the held views in (no copy where they already are the buffers' leading columns)
            self._key_buffer, self._value_buffer = buffers if buffers is not None else (None, None)
            self.keys, self.values = keys, values
            if buffers is not None and clear:
                self.clear_unheld_columns()

    def clear_unheld_columns(self) -> None:
        """Static mode: zero the buffers' columns past the held ones (a reused buffer's earlier contents), as a fresh
        static buffer's are."""
        assert self._key_buffer is not None and self._value_buffer is not None, "static buffers are held"
        self._key_buffer[:, :, self._length :].zero_()
        self._value_buffer[:, :, self._length :].zero_()

    def sync_device_length(self) -> None:
        """Static mode: set the device length to the host length (after a compiled step that raised before its
        host-side effects landed, the device length may be ahead)."""
        self.settle()
        if self._device_length is not None:
            self._device_length.fill_(self._length)

    def settle(self) -> None:
        """Add the columns written by static updates to the host length (eagerly, before it is read; the cache
        settles every layer when its length is asked, so a compiled step always starts from ``_unrecorded == 0``
        and never recompiles on it)."""
        if self._unrecorded:
            self._length = self._value_length = self._length + self._unrecorded
            self._unrecorded = 0

    def _set_length(self, length: int) -> None:
        self._length = self._value_length = length
        if self._device_length is not None:
            self._device_length.fill_(length)

    def _static_copy(self, buffer: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
        """Static mode: ``tensor``'s columns copied into ``buffer`` (a fresh zero buffer of ``max_cache_len``
        columns at a fixed address when ``buffer`` does not fit ``tensor``'s batch shape, dtype and device)."""
        batch, heads, columns, dim = tensor.shape
        if columns > self.capacity:
            raise CacheCapacityError(
                f"cannot hold {columns} tokens in a cache whose max_cache_len is {self.capacity}; build the "
                "ChunkReuseCache with a larger max_cache_len"
            )
        fits = (
            buffer is not None
            and buffer.shape == (batch, heads, self.capacity, dim)
            and (buffer.dtype, buffer.device) == (tensor.dtype, tensor.device)
        )
        with torch.inference_mode(False):  # ordinary tensors: crops and joins write them outside inference mode
            if not fits:
                buffer = tensor.new_zeros(batch, heads, self.capacity, dim)
                self._mark_static(buffer)
            if self._device_length is None or self._device_length.device != tensor.device:
                self._device_length = torch.zeros((), dtype=torch.long, device=tensor.device)
                self._mark_static(self._device_length)
        assert buffer is not None
        if tensor.data_ptr() != buffer.data_ptr() or tensor.stride() != buffer.stride():
            held = buffer[:, :, :columns]
            held.copy_(tensor.clone() if _shares_storage(tensor, buffer) else tensor)
        self.owned = True
        return buffer

    @staticmethod
    def _mark_static(tensor: torch.Tensor) -> None:
        """Tell dynamo the tensor keeps its address (CUDA graphs then read it in place), as ``StaticLayer`` does."""
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(tensor)

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns in owned buffers (copying the held ones once when it must grow)."""
        if self.owned and self.capacity >= columns:
            return
        if self.max_cache_len is not None:
            if columns > self.max_cache_len:
                raise CacheCapacityError(
                    f"cannot reserve {columns} tokens in a cache whose max_cache_len is {self.max_cache_len}"
                )
            if self._length:
                self.keys, self.values = self.keys, self.values  # into the static buffers
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
        whose first ``length`` columns are this layer's K/V. In static mode those columns are copied into the
        static buffers instead (so write the buffers before handing them over)."""
        if length > _columns(keys):
            raise CapacityError(f"length {length} exceeds the buffers' capacity of {_columns(keys)} columns")
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self.max_cache_len is not None:
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            return
        self._key_buffer, self._value_buffer, self.owned = keys, values, True
        self._length = self._value_length = length

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop`` (a negative count), keeping the buffers: the freed columns are reused."""
        if tokens_to_remove > 0:
            raise InputError(f"crop() takes a negative number of tokens to remove, got {tokens_to_remove}")
        self.settle()
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(self._length + tokens_to_remove, 0))

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys``/``values`` (a full-length stitched buffer)."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values


def _columns(tensor: torch.Tensor | None) -> int:
    return int(tensor.shape[-2]) if tensor is not None and tensor.dim() == 4 else 0


def _shares_storage(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


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
    the new ones, the mask's ``kv_offset`` being the index of the first of them. In static mode it returns the
    whole buffers like :class:`ChunkReuseLayer` and transformers' sliding-window mask (absolute column indices,
    offset 0) hides the columns outside the window: the same columns are attended.
    """

    is_sliding = True

    def __init__(self, sliding_window: int, max_cache_len: int | None = None) -> None:
        super().__init__(max_cache_len)
        if sliding_window < 1:
            raise ConfigError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.max_cache_len is not None:
            return self._static_update(key_states, value_states)
        past = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        visible = min(past, self.sliding_window - 1) + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.max_cache_len is not None:
            return self.max_cache_len, 0
        past = self.get_seq_length()
        return min(past, self.sliding_window - 1) + query_length, max(past - self.sliding_window + 1, 0)


def has_sliding_layers(model: PreTrainedModel) -> bool:
    """Whether ``model`` has a sliding-window attention layer (its ``layer_types``, as :func:`cache_layers` reads)."""
    layer_types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return "sliding_attention" in layer_types


def cache_layers(model: PreTrainedModel, max_cache_len: int | None = None) -> list[ChunkReuseLayer]:
    """One layer per decoder layer of ``model``, following its ``layer_types`` as ``DynamicCache(config=...)`` does;
    static (see the module doc) with ``max_cache_len``.

    Raises ``ValueError`` for layer kinds chunk reuse does not handle (chunked attention, linear attention, shared
    or attention-free layers), naming them.
    """
    layer_types, layer_kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    layers: list[ChunkReuseLayer] = []
    for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        if kind == "full_attention":
            layers.append(ChunkReuseLayer(max_cache_len))
        elif kind == "sliding_attention":
            layers.append(ChunkReuseSlidingLayer(int(kwargs["sliding_window"]), max_cache_len))
        else:
            raise UnsupportedModelError(
                f"ChunkReuseCache supports full and sliding-window attention layers; layer {index} of "
                f"{type(model).__name__} is {kind!r}"
            )
    return layers
