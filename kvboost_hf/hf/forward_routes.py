"""Stage 8 helper: the way each target forward of the model runner goes, graphed or eager, and running it.

The runner (:class:`~kvboost_hf.hf.decode.DecodeLoop`) says what to compute; :class:`ForwardRouter` decides whether
that forward runs through compiled graphs (:class:`~kvboost_hf.hf.graphs.GraphedDecoder` for plain decode steps and
prompt forwards over reused K/V, :class:`~kvboost_hf.hf.verify_graphs.GraphedVerifier` for speculative verify
forwards) or eagerly, pads what a graph needs (the cache's rows to a row bucket, a static capacity) and returns the
real rows' logits. Its one reason to change is the rules of that choice.

Invariants: a graphed forward and its eager twin return the same logits (fp32) for the real rows and leave the same
columns recorded in the cache (padding rows are copies of the last real row, never recorded or written back);
:attr:`ForwardRouter.forwards` counts every target forward run through it, one per call whichever way it went.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.graphs import GraphedDecoder, capacity_bucket, pad_rows, row_bucket
from kvboost_hf.hf.packed import packable
from kvboost_hf.hf.prefill import forward, run_forward
from kvboost_hf.hf.rows import DecodeRow
from kvboost_hf.hf.verify_graphs import GraphedVerifier
from kvboost_hf.offload.streamer import layer_streamer

__all__ = ["ForwardRouter", "forwards_pack"]


def _answer(rows: Sequence[DecodeRow]) -> int:
    """The most tokens any of ``rows`` may still take (what a static cache's capacity must hold after its context)."""
    return max(row.tokens_left for row in rows)


def forwards_pack(model: PreTrainedModel, graphs: GraphedDecoder | None, *, speculative: bool) -> bool:
    """Whether a runner of ``model`` may run its plain decode steps and dense prompt chunks as parts of a packed
    forward (:func:`~kvboost_hf.hf.packed.packed_forward`): no draft (``speculative``), no graphs (a graphed step is
    faster on the device that has them), a target that is not layer-streamed (a streamed step's copies are counted
    per runner) and whose attention can carry the parts (:func:`~kvboost_hf.hf.packed.packable`)."""
    if speculative or layer_streamer(model) is not None or (graphs is not None and graphs.config.enabled):
        return False
    return packable(model, [])


class ForwardRouter:
    """Runs the target forwards of one runner, each through the graphs where it fits, eagerly otherwise.

    Args:
        model: the target.
        graphs: graphs plain decode steps (a reuse cache with no context adjustment, at most the largest row bucket
            of rows) and prompt forwards whose uncached tail follows reused K/V and fits a query bucket
            (:class:`~kvboost_hf.hf.graphs.GraphedDecoder`, shared by the runners of one model so each shape is
            captured once): the cache is padded to the rows' bucket
            (:meth:`~kvboost_hf.hf.cache.ChunkReuseCache.pad_batch`) and turned static at a capacity bucket holding
            every row's remaining tokens (one K/V copy; the decode steps after a graphed prompt forward keep it).
            None: every decode step and prompt forward eager.
        verify_graphs: graphs the verify forwards of speculative steps where they fit
            (:class:`~kvboost_hf.hf.verify_graphs.GraphedVerifier`, shared like ``graphs``); None: eager.
        speculative: the runner drafts: its plain decode steps and prompt forwards run eagerly (the draft's cache
            follows the target's layout, which graphs' padding rows would break).

    ``forwards`` counts the forwards run (graphed and eager).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        graphs: GraphedDecoder | None,
        verify_graphs: GraphedVerifier | None,
        *,
        speculative: bool,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.verify_graphs = verify_graphs
        self.speculative = speculative
        self.forwards = 0

    def run(self, inputs: dict[str, Any], *, logits: bool = True) -> Any:
        """An eager forward of ``inputs`` (:func:`~kvboost_hf.hf.prefill.forward_inputs`' result, stored chunks
        loaded; a prompt chunk, a shared prefix); returns the model's output, the fed tokens recorded.
        ``logits=False``: the base model's output (no output head; :func:`~kvboost_hf.hf.prefill.run_forward`)."""
        output = run_forward(self.model, inputs, logits=logits)
        self.forwards += 1
        return output

    def decode(
        self,
        cache: ChunkReuseCache | DynamicCache | None,
        rows: Sequence[DecodeRow],
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """One plain decode step feeding each of ``rows`` its last token at ``positions`` ``[B]`` under the 2D
        ``mask`` ``[B, C]`` (the new column included); returns the logits ``[B, V]`` (fp32).

        Graphed when it fits (:meth:`_decode_capacity`): the cache padded to the rows' bucket and made static first
        when it is not, or too small; the padding rows fed copies of the last row's token, position and mask, their
        logits dropped. Recorded with the host's copy of the fed tokens (the real rows'), so no step waits on the
        device for them."""
        last_on_host = torch.tensor([[row.tokens[-1]] for row in rows], dtype=torch.long)
        last = last_on_host.to(mask.device, non_blocking=True)
        if (capacity := self._decode_capacity(cache, rows)) is None:
            return self._eager(cache, last, positions[:, None], mask)[:, -1, :]
        assert isinstance(cache, ChunkReuseCache), "a graphed step's cache is static"
        logits = self._graphed_decode(cache, rows, capacity, last, positions, mask)
        cache.record(last_on_host)
        return logits

    def decode_ahead(
        self,
        cache: ChunkReuseCache | DynamicCache | None,
        rows: Sequence[DecodeRow],
        fed: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """The plain decode step after the one whose tokens ``fed`` ``[B]`` (on the device) the host has not read
        yet: :meth:`decode`'s graphed step with those tokens fed, nothing recorded in the cache (the caller records
        them once it has read them). None, and nothing run, where the step would not run graphed (an eager forward
        records its fed tokens itself, reading them from the device)."""
        if (capacity := self._decode_capacity(cache, rows, taken=1)) is None:
            return None
        assert isinstance(cache, ChunkReuseCache), "a graphed step's cache is static"
        return self._graphed_decode(cache, rows, capacity, fed[:, None], positions, mask)

    def _graphed_decode(
        self,
        cache: ChunkReuseCache,
        rows: Sequence[DecodeRow],
        capacity: int,
        last: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The graphed plain step of :meth:`decode`, fed ``last`` ``[B, 1]`` (device), not recorded."""
        assert self.graphs is not None, "a graphed step has graphs"
        real, padded = len(rows), self.graphs.rows_for(len(rows))
        cache.pad_batch(padded)
        if cache.max_cache_len is None or cache.max_cache_len <= cache.get_seq_length():  # no room for this token
            self.graphs.adopt(cache)
            cache.set_max_cache_len(capacity)
        logits = self.graphs.step(cache, *(pad_rows(tensor, padded) for tensor in (last, positions[:, None], mask)))
        self.forwards += 1
        return logits[:real].float()

    def packs(self) -> bool:
        """Whether this runner's plain decode steps and dense prompt chunks may run as parts of a packed forward
        (:func:`~kvboost_hf.hf.packed.packed_forward`) instead of through :meth:`decode` and :meth:`run`
        (:func:`forwards_pack`)."""
        return forwards_pack(self.model, self.graphs, speculative=self.speculative)

    def prompt(
        self, cache: ChunkReuseCache | DynamicCache | None, inputs: dict[str, Any], rows: Sequence[DecodeRow]
    ) -> torch.Tensor:
        """A whole prompt forward of ``inputs`` (:func:`~kvboost_hf.hf.prefill.forward_inputs`' result, with any
        verify queries appended) for ``rows``: graphed where it fits (:meth:`graphed_prompt`), else eagerly.
        Returns the logits of its last ``inputs["logits_to_keep"]`` positions ``[P, keep, V]`` (fp32)."""
        if (logits := self.graphed_prompt(cache, inputs, rows)) is not None:
            return logits[:, None]
        keep = inputs["logits_to_keep"]
        return self.run(inputs).logits[:, -keep:, :].float()

    def prepare_prompt(
        self, cache: ChunkReuseCache | DynamicCache | None, rows: Sequence[DecodeRow], width: int, columns: int = 0
    ) -> None:
        """Before ``cache`` loads the stored chunks of a prompt forward ``width`` columns wide for ``rows`` (all
        real: a batch at its row bucket), let it copy them straight into the static buffers the graphed prompt
        forward will run on (:meth:`graphed_prompt`'s capacity, decided once the columns the chunks fill are
        known), so each reused byte is copied once. Nothing when that forward cannot be graphed in one call:
        no graphs, a draft, a plain cache, rows to pad, or a tail wider than ``columns`` (a token budget's chunk;
        0: none)."""
        if self.graphs is None or self.speculative or not isinstance(cache, ChunkReuseCache):
            return
        graphs, real, answer = self.graphs, len(rows), _answer(rows)
        if graphs.rows_for(real) != real:
            return

        held_by = weakref.ref(cache)  # the cache keeps this function: no reference cycle (its buffers go with it)

        def capacity(held: int) -> int | None:
            target = held_by()
            if target is None or target.expects_sparse_forward or not target.reuse_enabled:
                return None
            if target.attention_kwargs():
                return None
            if columns and width - held > columns:
                return None
            return graphs.prefill_capacity(real, held, width - held, answer)

        graphs.adopt(cache)
        cache.stitch_capacity = capacity

    def graphed_prompt(
        self, cache: ChunkReuseCache | DynamicCache | None, inputs: dict[str, Any], rows: Sequence[DecodeRow]
    ) -> torch.Tensor | None:
        """A prompt forward of the uncached tail in ``inputs`` (the reused K/V loaded) through the graphs
        (:meth:`~kvboost_hf.hf.graphs.GraphedDecoder.prefill`): the cache padded to the rows' bucket and made static
        at the capacity of the rows' context and answers (one K/V copy, which the decode steps after it keep), the
        padding rows fed copies of the last row, their logits dropped. Returns the real rows' last-token logits
        ``[P, V]`` (fp32), or None, running nothing, when it runs eagerly: no graphs, a draft, a plain cache, a
        sparse repair forward, a context adjustment, no reused column, or a shape the graphs refuse
        (:meth:`~kvboost_hf.hf.graphs.GraphedDecoder.prefill_capacity`)."""
        if self.graphs is None or self.speculative or not isinstance(cache, ChunkReuseCache):
            return None
        if cache.expects_sparse_forward or not cache.reuse_enabled or cache.attention_kwargs():
            return None
        fed = inputs["input_ids"]
        real, queries = fed.shape
        capacity = self.graphs.prefill_capacity(real, cache.num_columns, queries, _answer(rows))
        if capacity is None:
            return None
        padded = self.graphs.rows_for(real)
        cache.pad_batch(padded)
        self.graphs.adopt(cache)
        cache.set_max_cache_len(capacity)  # none of it when the stored chunks were stitched into it (prepare_prompt)
        tensors = (pad_rows(inputs[name], padded) for name in ("input_ids", "position_ids", "attention_mask"))
        logits = self.graphs.prefill(cache, *tensors)
        cache.record(fed)
        self.forwards += 1
        return logits[:real].float()

    def verify(
        self,
        cache: ChunkReuseCache | DynamicCache | None,
        rows: Sequence[DecodeRow],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: int,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """A speculative step's verify forward for ``rows`` (with ``cache`` and ``rows`` bound, the verifier's
        :data:`~kvboost_hf.hf.verify.TargetForward`): through the verify graphs where it fits
        (:meth:`GraphedVerifier.run <kvboost_hf.hf.verify_graphs.GraphedVerifier.run>`), else eagerly; logits
        ``[B, keep, V]`` (fp32)."""
        if self.verify_graphs is not None:
            logits = self.verify_graphs.run(cache, input_ids, position_ids, attention_mask, _answer(rows))
            if logits is not None:
                self.forwards += 1
                return logits
        return self._eager(cache, input_ids, position_ids, attention_mask, keep)

    def _eager(
        self,
        cache: ChunkReuseCache | DynamicCache | None,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keep: int = 1,
    ) -> torch.Tensor:
        """One eager forward through ``cache`` (stored chunks loaded first); the last ``keep`` positions' logits
        ``[B, keep, V]`` (fp32). A reuse cache left padded by a graphed verify forward drops its padding rows
        first."""
        if isinstance(cache, ChunkReuseCache) and cache.padding_rows:
            cache.pad_batch(input_ids.shape[0])
        out = forward(self.model, cache, input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, logits_to_keep=keep)  # fmt: skip
        self.forwards += 1
        return out.logits[:, -keep:, :].float()

    def _decode_capacity(
        self, cache: ChunkReuseCache | DynamicCache | None, rows: Sequence[DecodeRow], taken: int = 0
    ) -> int | None:
        """The static capacity (tokens) for a graphed plain decode step of ``rows`` (``taken``: tokens each row took
        that it does not hold yet), or None when the step runs eagerly (no graphs, a draft, a plain cache, a context
        adjustment, rows above the largest bucket, a capacity above the cap)."""
        if self.graphs is None or self.speculative or not isinstance(cache, ChunkReuseCache):
            return None
        if cache.attention_kwargs() or not self.graphs.config.enabled:
            return None
        if row_bucket(len(rows), self.graphs.config.row_buckets) is None:
            return None
        return capacity_bucket(cache.get_seq_length() + _answer(rows) - taken, self.graphs.config)
