"""Stage 6: :class:`ChunkReuseCache`, a drop-in ``transformers.Cache`` that stitches stored chunk K/V.

Use it like any cache::

    cache = ChunkReuseCache(store, model)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Data path of one ``generate`` call (the hooks live in :mod:`kvboost_hf.hf.hooks`):

1. before the first forward: the prompt's chunks are looked up; the longest run of exact (prefix-key) hits is
   stitched into the layers, and the forward's ``input_ids``/``position_ids`` are cut to the uncached tail, so
   the model computes only what is missing;
2. after each forward: the fed tokens are recorded; chunks they complete are written back to the store under
   their prefix keys (the next turn of a conversation hits the previous answer too). The write-back of a
   prompt forward is deferred to the next forward (or :meth:`ChunkReuseCache.flush`) so it never delays the
   first token.

Non-prefix reuse (``mode="chunk_kv_reuse"``, batch size 1): after the first prefix miss, later chunks may hit
by content key. Those are re-rotated to their new positions and repaired (:mod:`kvboost_hf.reuse.repair`): one
forward over the chosen tokens, the gaps and the live tail, at their absolute positions with a 4D mask, while
:meth:`ChunkReuseCache.update` scatters the fresh K/V into their slots before attention.

Invariants:

* ``self.tokens`` holds one token id per cached column (left padding included) and every layer holds exactly
  ``self.num_columns`` columns of K/V;
* K/V written back under a prefix key were computed (or loaded) with all preceding chunks as their real past
  (a row's ``exact_tokens`` counts the leading positions for which that holds);
* K/V written under a content key are stored rotated as if the chunk started at position 0;
* a call whose prompt does not extend the tokens already cached raises instead of attending to stale K/V.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, Span, chunk_spans
from kvboost_hf.core.config import GenerationMode, RecomputeStrategy, RepairConfig
from kvboost_hf.core.keys import chain_prefix_keys, content_key, make_namespace, prefix_key
from kvboost_hf.hf.hooks import install_hooks
from kvboost_hf.hf.models import model_dtype, num_cache_layers
from kvboost_hf.reuse.repair import most_deviating, position_mask, seam_positions
from kvboost_hf.reuse.rope import KeyRotator, UnsupportedRopeError
from kvboost_hf.store.chunk_store import ChunkStore

logger = logging.getLogger(__name__)


@dataclass
class RowReuse:
    """Reuse achieved for one batch row in the last prompt forward (tokens).

    ``cached_tokens`` were loaded and not recomputed; of them, ``approx_tokens`` came from content-key hits.
    ``recomputed_tokens`` is the repair work spent on loaded chunks.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_chunks: int = 0
    approx_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class _Hit:
    span: Span
    entry: ChunkKV
    exact: bool


class _ProbeDone(Exception):
    """Raised by :meth:`ChunkReuseCache.update` to stop a CacheBlend probe after its check layer."""


@dataclass
class _RowChunks:
    """Chunk bookkeeping of one batch row: spans and prefix keys so far, how many were written back, and how far
    its K/V are exact."""

    spans: list[Span] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    exact_tokens: int = 0
    stale: frozenset[int] = frozenset()  # positions holding loaded K/V that were neither exact nor recomputed

    def truncate(self, num_tokens: int) -> None:
        """Forget chunks that are no longer fully inside the first ``num_tokens`` tokens."""
        keep = sum(1 for _, end in self.spans if end <= num_tokens)
        del self.spans[keep:], self.keys[keep:]
        self.stored = min(self.stored, keep)
        self.exact_tokens = min(self.exact_tokens, num_tokens)

    def copy(self) -> _RowChunks:
        return _RowChunks(list(self.spans), list(self.keys), self.stored, self.exact_tokens, self.stale)


def _cat_or_only(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _stack_or_unsqueeze(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[L, H, T, D]`` per row -> ``[L, B, H, T, D]`` without a copy for a single row."""
    return rows[0].unsqueeze(1) if len(rows) == 1 else torch.stack(rows, dim=1)


def _is_leading_run(hits: list[_Hit]) -> bool:
    """True when the hits are exact and contiguous from the first token (the plain prefix-cache case)."""
    expected = 0
    for hit in hits:
        if not hit.exact or hit.span[0] != expected:
            return False
        expected = hit.span[1]
    return True


_ROTATORS: weakref.WeakKeyDictionary[torch.nn.Module, KeyRotator | None] = weakref.WeakKeyDictionary()


def _make_rotator(model: torch.nn.Module) -> KeyRotator | None:
    """A key rotator for ``model``, or None (logged once per model) when non-prefix reuse cannot be exact."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
    if getattr(config, "sliding_window", None) and "sliding_attention" in layer_types:
        logger.info("non-prefix reuse is off for sliding-window models (its repair mask has no window)")
        return None
    try:
        return KeyRotator(model)
    except UnsupportedRopeError as exc:
        logger.warning("%s", exc)
        return None


class ChunkReuseLayer(DynamicLayer):
    """A full-attention dynamic layer; stitched K/V are appended exactly like computed K/V.

    The first update of an empty layer adopts the given tensors instead of concatenating them to an empty one
    (one copy fewer for a stitched prefix).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.numel() == 0:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)


class ChunkReuseCache(Cache):
    """A ``transformers.Cache`` that loads chunk hits from a :class:`ChunkStore` and writes new chunks back.

    Args:
        store: where chunk K/V live.
        model: the model this cache serves (its identity and dtype name the store namespace).
        chunk_size: nominal chunk length in tokens.
        chunk_boundary_window: how far (tokens) a cut may slide back to follow a sentence or line end.
        boundary_token_ids: the token ids that end a sentence or line (needed with a boundary window).
        mode: a :class:`GenerationMode`.
        cache_salt: tenant isolation; caches with different salts never see each other's chunks.
        kv_cache_bits: the precision the store keeps K/V in (part of the namespace).
        write_back: store the chunks completed during generation.
        chunking: ``"fixed"`` or ``"content"`` (content-defined cut points, see :mod:`kvboost_hf.core.chunking`).
        segment_starts: token offsets where a new segment (document, question) starts: each starts a chunk, and
            segment chunks are also stored by content key so they hit at any position.
        recompute_strategy, recompute_ratio, check_layer, overlap_k, sink_tokens: repair of non-prefix hits
            (see :class:`~kvboost_hf.reuse.repair.RepairConfig`).
    """

    def __init__(
        self,
        store: ChunkStore,
        model: torch.nn.Module,
        *,
        chunk_size: int = 128,
        chunk_boundary_window: int = 0,
        boundary_token_ids: frozenset[int] | None = None,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        kv_cache_bits: int = 16,
        write_back: bool = True,
        chunking: str = "fixed",
        segment_starts: list[int] | tuple[int, ...] = (),
        recompute_strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE,
        recompute_ratio: float = 0.15,
        check_layer: int = 1,
        overlap_k: int = 2,
        sink_tokens: int = 0,
    ) -> None:
        super().__init__(layers=[ChunkReuseLayer() for _ in range(num_cache_layers(model))])
        self.store = store
        self.model = model
        self.mode = GenerationMode(mode)
        self.chunking = ChunkingConfig(
            chunk_size, chunk_boundary_window, frozenset(boundary_token_ids or ()), method=chunking
        )
        self.segment_starts = tuple(sorted(set(segment_starts)))
        self.repair = RepairConfig(recompute_strategy, recompute_ratio, check_layer, overlap_k, sink_tokens)
        self.namespace = make_namespace(model, model_dtype(model), self.chunking, kv_cache_bits, cache_salt)
        self.write_back = write_back and self.mode is not GenerationMode.BASELINE
        self.tokens = torch.empty(0, 0, dtype=torch.long)
        self.pads: list[int] = []
        self._rows: list[_RowChunks] = []
        self.last_reuse: list[RowReuse] = []
        self.reuse_enabled = True
        self._write_back_pending = False
        self._rotator = self._approximate_reuse_rotator()
        self.store_content = self._rotator is not None and (bool(self.segment_starts) or chunking == "content")
        self._scatter: torch.Tensor | None = None  # positions the current forward writes (repair and probe)
        self._probe_layer: int | None = None
        self._probe_deviation: torch.Tensor | None = None
        self._pending_tokens: torch.Tensor | None = None
        install_hooks(model)

    def _approximate_reuse_rotator(self) -> KeyRotator | None:
        """The key rotator when non-prefix reuse is possible for this model and mode, else None."""
        if self.mode is not GenerationMode.CHUNK_KV_REUSE:
            return None
        if self.model not in _ROTATORS:
            _ROTATORS[self.model] = _make_rotator(self.model)
        return _ROTATORS[self.model]

    # ------------------------------------------------------------------ state
    @property
    def num_columns(self) -> int:
        """Columns (token positions, padding included) held by every layer."""
        return int(self.tokens.shape[1])

    def row_tokens(self, row: int) -> list[int]:
        """The real (unpadded) token ids of ``row`` whose K/V are cached."""
        return self.tokens[row, self.pads[row] :].tolist()

    def check_extends(self, input_ids: torch.Tensor) -> None:
        """Raise unless ``input_ids`` (a full sequence handed to ``generate``) extends the cached tokens."""
        n = self.num_columns
        if n == 0:
            return
        if input_ids.shape[0] != self.tokens.shape[0] or input_ids.shape[1] <= n:
            raise ValueError(
                f"ChunkReuseCache holds {n} tokens for a batch of {self.tokens.shape[0]}; the new input "
                f"{tuple(input_ids.shape)} does not extend them. Use a fresh ChunkReuseCache per conversation."
            )
        if not torch.equal(input_ids[:, :n].to(self.tokens.device), self.tokens):
            raise ValueError(
                "ChunkReuseCache holds K/V for a different token sequence: the new prompt does not extend the "
                "cached conversation. Use a fresh ChunkReuseCache (or the same one only to continue a conversation)."
            )

    # ------------------------------------------------------------------ forward hooks
    def before_forward(self, kwargs: dict) -> None:
        """Stitch stored chunks for this forward's tokens and cut its inputs to what must be computed."""
        input_ids = kwargs.get("input_ids")
        if self._scatter is not None:
            return  # the CacheBlend probe's own forward
        if input_ids is None:
            if self.num_columns == 0:
                self.reuse_enabled = False  # inputs_embeds: token ids unknown, nothing to look up or store
            return
        if self.num_columns == 0:
            self._start(input_ids, kwargs.get("attention_mask"))
        # Skipped tokens produce no logits: only skip when the caller asks for the last ``logits_to_keep`` only
        # (generate() does; a plain forward with the default 0 wants every position's logits).
        keep = kwargs.get("logits_to_keep", 0)
        if not self.reuse_enabled or self.mode is GenerationMode.BASELINE or not isinstance(keep, int) or keep < 1:
            return
        if input_ids.shape[1] <= keep:
            return
        cached_before = self.num_columns
        full = torch.cat([self.tokens, input_ids.to(self.tokens.device)], dim=1)
        limit = full.shape[1] - keep
        looked_up = None
        if cached_before == 0 and full.shape[0] == 1 and self._rotator is not None:
            hits = self._lookup(0, full[0].tolist(), 0, limit, approximate=True)
            if hits and not _is_leading_run(hits):
                self._prepare_repair_forward(kwargs, full, hits, limit)
                return
            looked_up = [hits]
        skip = self._stitch_hits(full, limit, looked_up) - cached_before
        if skip <= 0:
            return
        kwargs["input_ids"] = input_ids[:, skip:]
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[..., skip:]

    def after_forward(self, kwargs: dict) -> None:
        """Record the tokens this forward computed and write completed chunks back."""
        if not self.reuse_enabled or self._probe_layer is not None:
            return
        if self._pending_tokens is not None:  # a repair forward filled every position of the prompt
            self.tokens, self._pending_tokens, self._scatter = self._pending_tokens, None, None
            fed_count = self.num_columns
        else:
            fed = kwargs["input_ids"].to(self.tokens.device)
            self.tokens = torch.cat([self.tokens, fed], dim=1)
            fed_count = fed.shape[1]
            for row, chunks in enumerate(self._rows):
                if chunks.exact_tokens == self.num_columns - fed_count - self.pads[row]:
                    chunks.exact_tokens = self.num_columns - self.pads[row]
        if self.layers[0].get_seq_length() != self.num_columns:
            self.reuse_enabled = False
            raise RuntimeError(
                f"ChunkReuseCache is inconsistent: layers hold {self.layers[0].get_seq_length()} positions but "
                f"{self.num_columns} tokens were fed; was the cache shared between two forwards?"
            )
        if self.write_back:
            if fed_count > 1 and not self._write_back_pending:
                self._write_back_pending = True  # a prompt forward: store its chunks after the first token
            else:
                self.flush()

    def flush(self, tail: bool = False) -> None:
        """Write back every chunk computed so far that is not stored yet (a no-op when all are stored).

        With ``tail``, also store each row's last, unfinished chunk (exact K/V only) under its prefix key and note
        its length in the store, so the next turn of a conversation recomputes only its new tokens. Call it once
        a generation is over (the engine does), not per step.
        """
        if not (self.write_back and self.reuse_enabled and self.num_columns):
            self._write_back_pending = False
            return
        self._write_back()
        self._write_back_pending = False
        if tail:
            for row in range(self.tokens.shape[0]):
                self._store_tail(row)

    def _store_tail(self, row: int) -> None:
        """Store the row's last, unfinished chunk when its K/V are exact, and note its length in the store."""
        tokens = self.row_tokens(row)
        chunks = self._rows[row]
        start = chunks.spans[-1][1] if chunks.spans else 0
        if not start < len(tokens) <= chunks.exact_tokens:
            return
        parent = chunks.keys[-1] if chunks.keys else None
        key = prefix_key(self.namespace, parent, tokens[start:])
        if not self.store.contains(key):
            self.store.put(key, self._row_entry(row, start, len(tokens)))
        self.store.note_tail(parent, len(tokens) - start)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (ordinary forwards), or scatter into the ``self._scatter`` positions (repair and probe)."""
        if self._scatter is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        probing = self._probe_layer == layer_idx
        if probing:
            stored = layer.keys.index_select(2, self._scatter)
            self._probe_deviation = (key_states.float() - stored.float()).pow(2).sum(dim=(0, 1, 3))
        layer.keys.index_copy_(2, self._scatter, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, self._scatter, value_states.to(layer.values.dtype))
        if probing:
            raise _ProbeDone
        return layer.keys, layer.values

    # ------------------------------------------------------------------ lookup and exact stitching
    def _start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """First forward of this cache: learn the batch layout (left padding)."""
        batch = input_ids.shape[0]
        self.tokens = torch.empty(batch, 0, dtype=torch.long, device="cpu")
        self._rows = [_RowChunks() for _ in range(batch)]
        self.pads = [0] * batch
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask.to("cpu", torch.long)
            pads = (mask.cumsum(-1) == 0).sum(-1)
            ends_ok = all(bool(mask[i, int(p) :].all()) for i, p in enumerate(pads))
            if not ends_ok:
                logger.warning("ChunkReuseCache: attention mask is not left padding; reuse disabled for this call")
                self.reuse_enabled = False
            self.pads = [int(p) for p in pads]
        elif attention_mask is not None:
            logger.warning("ChunkReuseCache: custom %dD attention mask; reuse disabled", attention_mask.dim())
            self.reuse_enabled = False

    def _extend_chunks(self, row: int, tokens: list[int]) -> _RowChunks:
        """Bring the row's spans and prefix keys up to date with ``tokens`` (its real tokens so far)."""
        chunks = self._rows[row]
        start = chunks.spans[-1][1] if chunks.spans else 0
        new_spans = chunk_spans(tokens, self.chunking, start, self.segment_starts)
        parent = chunks.keys[-1] if chunks.keys else None
        chunks.keys += chain_prefix_keys(self.namespace, tokens, new_spans, parent)
        chunks.spans += new_spans
        return chunks

    def _lookup(
        self,
        row: int,
        tokens: list[int],
        present: int,
        limit: int,
        approximate: bool,
        loaded: dict[str, ChunkKV | None] | None = None,
    ) -> list[_Hit]:
        """Hits for the row's chunks after its first ``present`` tokens that start before ``limit``.

        Without ``approximate`` the lookup stops at the first prefix-key miss; with it, every later chunk is
        looked up by prefix key, then by content key, and misses are gaps. ``loaded`` memoises store reads
        across the rows of a batch, so a shared prefix is read from the store once.
        """
        chunks = self._extend_chunks(row, tokens)
        loaded = {} if loaded is None else loaded
        hits: list[_Hit] = []
        missed = False
        for index, (span, key) in enumerate(zip(chunks.spans, chunks.keys, strict=True)):
            if span[1] <= present:
                continue
            if span[0] >= limit:
                break
            if key not in loaded:
                loaded[key] = self.store.get(key)
            if loaded[key] is not None:
                hits.append(_Hit(span, loaded[key], exact=True))
                continue
            parent = chunks.keys[index - 1] if index else None
            tail = None if missed else self._lookup_tail(parent, tokens, span[0], span[1] - span[0] - 1, loaded)
            missed = True
            if tail is not None:
                hits.append(tail)
            if not approximate:
                break
            if tail is None and (
                entry := self.store.get(content_key(self.namespace, tokens[span[0] : span[1]]))
            ) is not None:
                hits.append(_Hit(span, entry, exact=False))
        start = chunks.spans[-1][1] if chunks.spans else 0
        if not missed and present <= start < limit:  # all full chunks are in: look for the stored live tail
            parent = chunks.keys[-1] if chunks.keys else None
            tail = self._lookup_tail(parent, tokens, start, len(tokens) - start, loaded)
            hits += [tail] if tail is not None else []
        return hits

    def _lookup_tail(
        self, parent: str | None, tokens: list[int], start: int, max_tokens: int, loaded: dict[str, ChunkKV | None]
    ) -> _Hit | None:
        """The longest stored partial chunk (at most ``max_tokens``) after the chunk keyed ``parent`` and starting
        at token ``start``: the exact K/V of an earlier call's last, unfinished chunk (see :meth:`flush`)."""
        for length in self.store.tail_lengths(parent):
            if not 0 < length <= max_tokens:
                continue
            key = prefix_key(self.namespace, parent, tokens[start : start + length])
            if key not in loaded:
                loaded[key] = self.store.get(key)
            if loaded[key] is not None:
                return _Hit((start, start + length), loaded[key], exact=True)
        return None

    def _stitch_hits(self, full: torch.Tensor, limit: int, looked_up: list[list[_Hit]] | None = None) -> int:
        """Append stored K/V for the leading exact hits of every row; return the columns now covered.

        Row ``i`` is covered up to column ``pads[i] + hit_tokens[i]``; the batch can only skip columns covered
        in every row, and never column ``limit`` or later (those tokens must produce logits).
        """
        n = self.num_columns
        row_hits: list[list[tuple[Span, ChunkKV]]] = []
        covered_columns: list[int] = []
        loaded: dict[str, ChunkKV | None] = {}
        for row in range(full.shape[0]):
            present = max(n - self.pads[row], 0)
            if looked_up is None:
                tokens = full[row, self.pads[row] :].tolist()
                hits = self._lookup(row, tokens, present, limit - self.pads[row], False, loaded)
            else:
                hits = looked_up[row]
            row_hits.append([(hit.span, hit.entry) for hit in hits])
            covered_columns.append(self.pads[row] + (hits[-1].span[1] if hits else present))
        target = min(*covered_columns, limit)
        self.last_reuse = [
            RowReuse(full.shape[1] - pad, max(0, target - pad), len(entries))
            for pad, entries in zip(self.pads, row_hits, strict=True)
        ]
        if target <= n or not any(row_hits):
            return n
        for layer_idx, (keys, values) in enumerate(self._assemble(row_hits, n, target)):
            self.layers[layer_idx].update(keys, values)
        self.tokens = full[:, :target].clone()
        for row, chunks in enumerate(self._rows):
            done = sum(1 for _, end in chunks.spans if end <= target - self.pads[row])
            chunks.stored = max(chunks.stored, done)
            chunks.exact_tokens = max(chunks.exact_tokens, target - self.pads[row])
        return target

    def _assemble(
        self, row_hits: list[list[tuple[Span, ChunkKV]]], start: int, stop: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)`` shaped ``[B, H_kv, stop - start, D]`` for columns ``[start, stop)``.

        Columns left of a row's padding get zeros (the attention mask hides them); the others come from the
        row's hits, which cover its tokens ``[first hit start, stop - pad)``.
        """
        reference = next(entry for entries in row_hits for _, entry in entries)
        layers, heads, _, head_dim = reference.keys.shape
        per_row: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pad, entries in zip(self.pads, row_hits, strict=True):
            lo, hi = start - pad, stop - pad  # token indices wanted for this row
            num_pad = min(max(0, -lo), stop - start)
            parts_k = [reference.keys.new_zeros(layers, heads, num_pad, head_dim)]
            parts_v = [reference.values.new_zeros(layers, heads, num_pad, head_dim)]
            if hi > max(lo, 0):
                offset = entries[0][0][0]
                keys = torch.cat([entry.keys for _, entry in entries], dim=2)
                values = torch.cat([entry.values for _, entry in entries], dim=2)
                parts_k.append(keys[:, :, max(lo, 0) - offset : hi - offset])
                parts_v.append(values[:, :, max(lo, 0) - offset : hi - offset])
            if num_pad == 0:
                parts_k, parts_v = parts_k[1:], parts_v[1:]
            per_row.append((_cat_or_only(parts_k, dim=2), _cat_or_only(parts_v, dim=2)))
        device, dtype = self._device_and_dtype()
        all_k = _stack_or_unsqueeze([k for k, _ in per_row]).to(device=device, dtype=dtype, non_blocking=True)
        all_v = _stack_or_unsqueeze([v for _, v in per_row]).to(device=device, dtype=dtype, non_blocking=True)
        return zip(all_k.unbind(0), all_v.unbind(0), strict=True)

    def _device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        param = next(self.model.parameters())
        return param.device, model_dtype(self.model)

    # ------------------------------------------------------------------ repair path (non-prefix hits)
    def _prepare_repair_forward(self, kwargs: dict, full: torch.Tensor, hits: list[_Hit], limit: int) -> None:
        """Stitch every hit at its position (re-rotating content hits), choose the tokens to recompute, and turn
        this forward into one over those tokens, the gaps and the live tail (batch size 1)."""
        length = full.shape[1]
        device, dtype = self._device_and_dtype()
        layers, heads, _, head_dim = hits[0].entry.keys.shape
        keys = torch.zeros(layers, 1, heads, length, head_dim, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        reused = torch.zeros(length, dtype=torch.bool)
        approx = torch.zeros(length, dtype=torch.bool)
        approx_spans: list[Span] = []
        for hit in hits:
            start, end = hit.span[0], min(hit.span[1], limit)
            hit_keys = hit.entry.keys if hit.exact else self._rotator.rotate(hit.entry.keys, start)
            keys[:, 0, :, start:end] = hit_keys[:, :, : end - start].to(device=device, dtype=dtype)
            values[:, 0, :, start:end] = hit.entry.values[:, :, : end - start].to(device=device, dtype=dtype)
            reused[start:end] = True
            if not hit.exact:
                approx[start:end] = True
                approx_spans.append((start, end))
        for layer, layer_keys, layer_values in zip(self.layers, keys, values, strict=True):
            layer.lazy_initialization(layer_keys, layer_values)
            layer.keys, layer.values = layer_keys, layer_values
        fresh = ~reused
        sinks = slice(0, self.repair.sink_tokens)
        fresh[sinks] |= approx[sinks]
        recompute = fresh.clone()
        recompute[self._choose_repairs(full, approx_spans, approx, fresh)] = True
        positions = recompute.nonzero().squeeze(1)
        stale = (approx & ~recompute).nonzero().squeeze(1).tolist()
        chunks = self._rows[0]
        chunks.stale = frozenset(stale)
        chunks.exact_tokens = stale[0] if stale else length
        self.last_reuse = [
            RowReuse(
                prompt_tokens=length,
                cached_tokens=int((reused & ~recompute).sum()),
                hit_chunks=len(hits),
                approx_tokens=len(stale),
                recomputed_tokens=int((reused & recompute).sum()),
            )
        ]
        self._scatter = positions.to(device)
        self._pending_tokens = full.clone()
        kwargs["input_ids"] = full[:, positions].to(kwargs["input_ids"].device)
        kwargs["position_ids"] = positions[None].to(device)
        kwargs["attention_mask"] = position_mask(positions.to(device), length, dtype)

    def _choose_repairs(
        self, full: torch.Tensor, approx_spans: list[Span], approx: torch.Tensor, fresh: torch.Tensor
    ) -> list[int]:
        """Positions of loaded content-hit tokens to recompute under the configured strategy."""
        strategy, ratio = self.repair.strategy, self.repair.ratio
        if not approx_spans or strategy is RecomputeStrategy.NONE:
            return []
        if ratio >= 1.0:
            return approx.nonzero().squeeze(1).tolist()
        if strategy is RecomputeStrategy.SELECTIVE:
            return seam_positions(approx_spans, self.repair)
        probe_positions = (approx | fresh).nonzero().squeeze(1)
        deviation = self._probe(full, probe_positions)
        candidates = approx[probe_positions]
        return most_deviating(probe_positions[candidates], deviation[candidates], ratio)

    def _probe(self, full: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """CacheBlend probe: run the first ``check_layer + 1`` layers over ``positions`` (their fresh K/V replace
        the stitched ones in those layers) and return each position's squared key deviation at the check layer."""
        device, dtype = self._device_and_dtype()
        self._scatter = positions.to(device)
        self._probe_layer = min(self.repair.check_layer, len(self.layers) - 1)
        try:
            self.model(
                input_ids=full[:, positions].to(device),
                position_ids=positions[None].to(device),
                attention_mask=position_mask(positions.to(device), full.shape[1], dtype),
                past_key_values=self,
                use_cache=True,
                logits_to_keep=1,
            )
        except _ProbeDone:
            pass
        finally:
            self._probe_layer, self._scatter = None, None
        deviation, self._probe_deviation = self._probe_deviation, None
        return deviation.cpu()

    # ------------------------------------------------------------------ write-back
    def _write_back(self) -> None:
        """Store the chunks computed since the last write-back: under their prefix key when their K/V are exact,
        and (segments, content chunking) under their content key, re-rotated to position 0."""
        for row in range(self.tokens.shape[0]):
            tokens = self.row_tokens(row)
            chunks = self._extend_chunks(row, tokens)
            for index in range(chunks.stored, len(chunks.spans)):
                start, end = chunks.spans[index]
                exact = end <= chunks.exact_tokens
                wants_content = self.store_content and not chunks.stale.intersection(range(start, end))
                if not exact and not wants_content:
                    continue
                entry = self._row_entry(row, start, end)
                if exact and not self.store.contains(chunks.keys[index]):
                    self.store.put(chunks.keys[index], entry)
                if wants_content:
                    key = content_key(self.namespace, tokens[start:end])
                    if not self.store.contains(key):
                        self.store.put(key, ChunkKV(self._rotator.rotate(entry.keys, -start), entry.values))
            chunks.stored = len(chunks.spans)

    def _row_entry(self, row: int, start: int, end: int) -> ChunkKV:
        """A copy of the K/V of ``row``'s tokens ``[start, end)`` in every layer."""
        pad = self.pads[row]
        return ChunkKV(
            torch.stack([layer.keys[row, :, pad + start : pad + end] for layer in self.layers]),
            torch.stack([layer.values[row, :, pad + start : pad + end] for layer in self.layers]),
        )

    # ------------------------------------------------------------------ generation strategies
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (assisted decoding); like ``DynamicCache.crop``, a positive
        value is refused and 0 is a no-op."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes a negative number of tokens to remove, got {tokens_to_remove}")
        length = max(0, self.num_columns + tokens_to_remove)
        if length == self.num_columns:
            return
        super().crop(length - self.num_columns)
        self.tokens = self.tokens[:, :length]
        for row, chunks in enumerate(self._rows):
            chunks.truncate(length - self.pads[row])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select_rows([row for row in range(self.tokens.shape[0]) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select_rows(torch.as_tensor(indices).tolist())

    def _select_rows(self, rows: list[int]) -> None:
        if self.tokens.shape[0] == 0:
            return
        self.tokens = self.tokens[rows]
        self.pads = [self.pads[r] for r in rows]
        self._rows = [self._rows[r].copy() for r in rows]
