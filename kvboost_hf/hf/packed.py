"""Stage 8 helper: one model forward for the new tokens of several batches, each reading its own cache.

A decode step of running rows and a chunk of a joining prompt run as two forwards read every weight twice; where a
forward of a few dozen tokens costs about its weight reads (a CPU, or a GPU's decode step), that second read is most
of what a join adds to the running rows' step. Packed (vLLM's mixed batch), the tokens of every part are laid side
by side in one row ``[1, N]``: embeddings, projections, norms, rotary embeddings (per-token positions) and the MLP
run once over the ``N`` tokens, and only attention runs per part, its queries against its own cache under its own
mask. :class:`PackedCaches` is the cache the model sees: it writes each part's new K/V into that part's cache and
holds what the cache returns for the attention, which ``attn_implementation="kvboost"`` hands to
:meth:`PackedCaches.attention` when the forward carries :data:`PACKED_KWARG`.

Where it applies (:func:`packable`): the ``"kvboost"`` attention, full or sliding-window attention layers (a sliding
layer's part masked as transformers masks it: :func:`layer_windows`), no soft-capped attention, no context
adjustment, no sparse repair forward. Invariants: each part's cache ends holding and recording what its own forward
would leave (the same K/V, up to the floating-point order of one matmul over more rows, and the same tokens
recorded), and each part's logits are those of its own forward's last position per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from kvboost_hf.core.errors import StateError
from kvboost_hf.hf.attention import PACKED_KWARG, bottom_right_causal_mask
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.hf.prefill import reuse_cache
from kvboost_hf.reuse.rope import exact_reuse_length


@dataclass(frozen=True)
class ForwardPart:
    """One batch's share of a packed forward: ``input_ids`` and ``position_ids`` ``[R, T]`` (R rows of T new tokens)
    fed through ``cache`` under the 2D ``attention_mask`` ``[R, K]`` (every column the cache holds plus the T new
    ones; 0 = padding); ``logits``: return each row's last-position logits."""

    cache: Any
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: bool

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """This part's slice ``[1, H, R*T, D]`` of a packed projection as ``[R, H, T, D]`` (a view)."""
        rows, queries = self.input_ids.shape
        return packed[0].unflatten(1, (rows, queries)).transpose(0, 1)

    def plain_causal(self) -> bool:
        """No padding, and one query per row or as many queries as keys (a whole prompt): torch SDPA's own
        ``is_causal`` (top-left aligned) is then exactly bottom-right causal, with no mask to build or read."""
        queries, keys = self.input_ids.shape[1], self.attention_mask.shape[1]
        return queries in (1, keys) and bool(self.attention_mask.bool().all())

    def causal_mask(self) -> torch.Tensor:
        """Boolean ``[R, 1, T, K]``: query ``t`` of row ``r`` sees key ``j`` when the row holds it and
        ``j <= K - T + t`` (bottom-right causal), as transformers' sdpa mask. A query that sees no key (left padding
        of a prompt) gets zeros from torch's SDPA (torch >= 2.5), as in the part's own forward."""
        queries, keys = self.input_ids.shape[1], self.attention_mask.shape[1]
        causal = bottom_right_causal_mask(queries, keys, self.attention_mask.device)
        return self.attention_mask.bool()[:, None, None, :] & causal


def layer_windows(model: PreTrainedModel) -> list[int | None] | None:
    """Per decoder layer of ``model``: None for full attention, the window (tokens) for sliding-window attention;
    None when a layer is of another kind (chunked, linear, ...), which a packed forward does not serve."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    windows: list[int | None] = []
    for kind, kwargs in zip(layer_types, layer_kwargs, strict=True):
        if kind not in ("full_attention", "sliding_attention"):
            return None
        windows.append(int(kwargs["sliding_window"]) if kind == "sliding_attention" else None)
    return windows


def packable(model: PreTrainedModel, caches: Sequence[Any]) -> bool:
    """Whether one packed forward of ``model`` can serve parts through ``caches``: the ``"kvboost"`` attention,
    full or sliding-window attention layers (:func:`layer_windows`) without soft-capping, RoPE frequencies that do
    not depend on the length (:func:`~kvboost_hf.reuse.rope.exact_reuse_length`: transformers picks them from the
    largest position of the whole forward, so one part's positions would change another's), and no cache that is
    static (a graph's: it returns its whole capacity), has a context adjustment or an armed sparse repair forward."""
    if getattr(model.config, "_attn_implementation", None) != "kvboost" or layer_windows(model) is None:
        return False
    if exact_reuse_length(model) is not None:
        return False
    if getattr(model.config.get_text_config(decoder=True), "attn_logit_softcapping", None) is not None:
        return False
    for cache in caches:
        if getattr(cache, "expects_sparse_forward", False) or getattr(cache, "max_cache_len", None) is not None:
            return False
        if hasattr(cache, "attention_kwargs") and cache.attention_kwargs():
            return False
    return True


class PackedCaches(Cache):
    """The cache a packed forward passes to the model: :meth:`update` splits each layer's new K/V ``[1, H_kv, N, D]``
    by part and writes each slice into its part's cache; :meth:`attention` attends each part's queries to what that
    cache returned. ``windows``: per layer, None (full attention: each part's :meth:`ForwardPart.causal_mask`) or a
    sliding window (tokens: the part's mask is transformers' sliding-window mask over the columns its cache returns,
    from the sizes it announces, ``get_mask_sizes``). Masks are built once per forward and shape, not per layer.

    The model builds no mask of its own for it: :meth:`get_mask_sizes` reports the packed tokens as the whole
    context, which ``kvboost_mask`` answers with None (plain causal, nothing materialised)."""

    def __init__(self, parts: Sequence[ForwardPart], windows: Sequence[int | None]) -> None:
        super().__init__(layers=[])
        self.parts = tuple(parts)
        self.windows = tuple(windows)
        ends = torch.tensor([part.tokens for part in self.parts]).cumsum(0).tolist()
        self.spans = [(end - part.tokens, end) for part, end in zip(self.parts, ends, strict=True)]
        # full layers: no mask where the part has no padding and its queries are all its keys or one (SDPA's own
        # causal path, which skips the masked half of a whole prompt), else the explicit one
        self.masks = [None if part.plain_causal() else part.causal_mask() for part in self.parts]
        self._sliding_masks: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._held: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        held = []
        for index, (part, (start, end)) in enumerate(zip(self.parts, self.spans, strict=True)):
            mask = self._mask(index, layer_idx)  # before the update: the sizes are the cache's past and the new
            keys, values = (part.unpack(tensor[:, :, start:end]) for tensor in (key_states, value_states))
            held.append((*part.cache.update(keys, values, layer_idx), mask))
        self._held[layer_idx] = held
        return key_states, value_states  # what the attention reads is held per part (see :meth:`attention`)

    def _mask(self, index: int, layer_idx: int) -> torch.Tensor | None:
        """Part ``index``'s boolean mask ``[R, 1, T, kv]`` at layer ``layer_idx``, before its update (None: plain
        causal, :meth:`ForwardPart.plain_causal`)."""
        window = self.windows[layer_idx]
        if window is None:
            return self.masks[index]
        part = self.parts[index]
        queries = part.input_ids.shape[1]
        kv_length, kv_offset = part.cache.get_mask_sizes(queries, layer_idx)
        key = (index, window, kv_length, kv_offset)
        if key not in self._sliding_masks:
            mask = sdpa_mask(
                batch_size=part.input_ids.shape[0], q_length=queries, kv_length=kv_length,
                q_offset=part.attention_mask.shape[1] - queries, kv_offset=kv_offset,
                mask_function=sliding_window_causal_mask_function(window), attention_mask=part.attention_mask.bool(),
                allow_is_causal_skip=False, device=part.attention_mask.device,
            )  # fmt: skip
            assert mask is not None, "no causal skip was allowed"
            self._sliding_masks[key] = mask
        return self._sliding_masks[key]

    def attention(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Each part's queries of ``query`` ``[1, H, N, D]`` attended to its cache's K/V of layer ``layer_idx``
        (written by :meth:`update` just before) -> ``[1, N, H, D]``."""
        if layer_idx not in self._held:
            raise StateError(f"layer {layer_idx} attends before its K/V were written in the packed forward")
        outputs = []
        for part, (start, end), (keys, values, mask) in zip(
            self.parts, self.spans, self._held.pop(layer_idx), strict=True
        ):
            out = torch.nn.functional.scaled_dot_product_attention(
                part.unpack(query[:, :, start:end]), keys, values, attn_mask=mask, scale=scaling,
                is_causal=mask is None and part.input_ids.shape[1] > 1, enable_gqa=keys.shape[1] != query.shape[1],
            )  # fmt: skip
            outputs.append(out.permute(0, 2, 1, 3).flatten(0, 1)[None])
        return torch.cat(outputs, dim=1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


def packed_forward(model: PreTrainedModel, parts: Sequence[ForwardPart]) -> list[torch.Tensor | None]:
    """One forward of ``model`` over every part's new tokens (check :func:`packable` first); each part's cache
    records its tokens (a reuse cache's ``record``). Returns per part its rows' last-position logits ``[R, V]``
    (fp32), or None for a part that asked for none."""
    input_ids = torch.cat([part.input_ids.reshape(1, -1) for part in parts], dim=1)
    position_ids = torch.cat([part.position_ids.reshape(1, -1) for part in parts], dim=1)
    windows = layer_windows(model)
    if windows is None:
        raise StateError("a packed forward serves full and sliding-window attention layers only (see packable)")
    caches = PackedCaches(parts, windows)
    last = [
        torch.arange(end - part.tokens + part.input_ids.shape[1] - 1, end, part.input_ids.shape[1])
        for part, (_, end) in zip(parts, caches.spans, strict=True)
        if part.logits
    ]
    inputs: dict[str, Any] = {
        "input_ids": input_ids, "position_ids": position_ids, "attention_mask": None, CACHE_ARGUMENT: caches,
        "use_cache": True, PACKED_KWARG: caches,
    }  # fmt: skip
    with torch.inference_mode():
        if last:
            logits = model.forward(**inputs, logits_to_keep=torch.cat(last).to(input_ids.device)).logits[0].float()
        else:
            getattr(model, "base_model", model).forward(**inputs)
    for part in parts:
        if (reusing := reuse_cache(part.cache)) is not None:
            reusing.record(part.input_ids)
    results: list[torch.Tensor | None] = []
    taken = 0
    for part in parts:
        if part.logits:
            rows = part.input_ids.shape[0]
            results.append(logits[taken : taken + rows])
            taken += rows
        else:
            results.append(None)
    return results
