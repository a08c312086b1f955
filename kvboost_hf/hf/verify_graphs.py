"""Stage 8 helper: the verify forwards of speculative decoding (chain and tree drafts) run as compiled graphs (CUDA
graphs on a GPU), one per ``(rows, capacity, draft tokens)`` bucket.

A verify forward feeds, per row, its last token (the root) and the ``k`` draft tokens of its tree, under an additive
4D tree mask (:func:`~kvboost_hf.hf.speculative.tree_attention_mask`), and keeps the logits of all ``1 + k`` queries.
:class:`GraphedVerifier` runs it through the :class:`~kvboost_hf.hf.graphs.GraphedDecoder`'s compiled ``forward``
over the static-mode :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (its capacity from
:func:`~kvboost_hf.hf.graphs.capacity_bucket`), so one graph serves every context length, every draft count up to a
bucket of :attr:`GraphConfig.draft_buckets <kvboost_hf.hf.graphs.GraphConfig.draft_buckets>` and every row count up
to a row bucket:

* draft tokens are padded up to the bucket with padding nodes (the root's token at the root's position) that see
  the root's columns only (the context and the root: never a NaN row) and that no real query sees; their K/V land
  in the columns after the real nodes', which the verifier drops with the rejected nodes (it keeps each row's
  accepted path only), so nothing padded is kept, attended or written back;
* rows are padded up to the row bucket with copies of the last row
  (:meth:`~kvboost_hf.hf.cache.ChunkReuseCache.pad_batch`; rows never see each other), whose logits are dropped;
  the verifier's column selection keeps them (copies of the last row's kept columns), so from one graphed verify
  to the next the static buffers keep their shape and address (a CUDA graph replays, no re-record); an eager
  forward drops them first.

Invariant: the real queries see exactly the columns the eager verify shows them (the 4D mask is the eager one,
widened with masked columns), so the logits, the accepted tokens and the kept K/V are the eager verify's (up to the
last bits a matrix product's shape can change on a GPU; identical in fp32 on a CPU).

Any other verify forward (graphs off, a plain cache, a context adjustment, rows or draft tokens above the buckets,
a capacity above ``max_capacity``, no room under ``max_graphs`` or ``max_capture_bytes`` (decode and verify graphs
count together), a shape whose compile failed) runs eagerly over a growing cache, with the same results.

A verify shape compiles at its first forward, inside a request, unless warmed up before:
:meth:`GraphedDecoder.warm_up <kvboost_hf.hf.graphs.GraphedDecoder.warm_up>` given a
:class:`~kvboost_hf.hf.graphs.VerifyShape` and this verifier runs :meth:`GraphedVerifier.warm_shape` on a dummy cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.graphs import (
    WARM_UP_STEPS,
    GraphedDecoder,
    VerifyShape,
    capacity_bucket,
    draft_bucket,
    pad_rows,
    row_bucket,
)
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.hf.speculative import tree_attention_mask

__all__ = ["GraphedVerifier"]

logger = logging.getLogger(__name__)


class GraphedVerifier:
    """Verify forwards through the compiled ``forward`` of ``graphs`` (shared by every loop of one model, as
    ``graphs`` is) when they fit a graph; :meth:`run` says when they do not, and the caller runs them eagerly.

    ``graphed_verifies``/``eager_verifies`` count the verify forwards each way; ``shapes`` maps each
    :class:`~kvboost_hf.hf.graphs.VerifyShape` run graphed (one graph each) to its runs; ``failed`` holds those
    whose compile raised (logged once; eager from then on); ``warmed`` those a warm-up captured
    (:meth:`GraphedDecoder.warm_up <kvboost_hf.hf.graphs.GraphedDecoder.warm_up>` with this verifier:
    :meth:`warm_shape`). Graph memory is added to ``graphs.capture_bytes``, as a decode graph's is.
    """

    def __init__(self, graphs: GraphedDecoder) -> None:
        self.graphs = graphs
        graphs.verifiers.append(self)  # its graphs count against the decoder's max_graphs as well
        self.graphed_verifies = 0
        self.eager_verifies = 0
        self.shapes: dict[VerifyShape, int] = {}
        self.failed: set[VerifyShape] = set()
        self.warmed: set[VerifyShape] = set()

    def shape(self, cache: Any, rows: int, nodes: int, answer: int) -> VerifyShape | None:
        """The graph of a verify forward of ``nodes`` draft tokens per row for ``rows`` rows over ``cache``, whose
        rows may still take ``answer`` tokens: the rows' bucket, the cache's capacity (its own when it is static
        with room for the root and the padded nodes, else the capacity bucket of the held columns, the padded
        nodes and the answer) and the nodes' bucket; None when it runs eagerly (see the module doc)."""
        config = self.graphs.config
        if not (config.enabled and isinstance(cache, ChunkReuseCache)) or cache.attention_kwargs():
            return None
        bucket, drafts = row_bucket(rows, config.row_buckets), draft_bucket(nodes, config.draft_buckets)
        if bucket is None or drafts is None:
            return None
        needed = cache.get_seq_length() + 1 + drafts
        static = cache.max_cache_len is not None and cache.max_cache_len >= needed
        capacity = cache.max_cache_len if static else capacity_bucket(needed + answer, config)
        if capacity is None:
            return None
        shape = VerifyShape(bucket, capacity, drafts)
        return shape if shape in self.shapes or self.may_warm(shape) else None

    def may_warm(self, shape: VerifyShape) -> bool:
        """Whether ``shape``, not graphed yet, may be: not failed, and room for one more graph (``max_graphs``,
        decode and verify graphs together; the capture memory cap)."""
        config = self.graphs.config
        if shape in self.failed or shape in self.shapes:
            return False
        cap = config.max_capture_bytes
        room = self.graphs.graph_count < config.max_graphs
        return room and (cap is None or self.graphs.capture_bytes < cap)

    def warm_shape(self, cache: ChunkReuseCache, shape: VerifyShape) -> bool | None:
        """Warm ``shape`` up on the empty dummy ``cache`` (a warm-up's, see :meth:`GraphedDecoder.warm_up
        <kvboost_hf.hf.graphs.GraphedDecoder.warm_up>`): one column per row, then :data:`~kvboost_hf.hf.graphs.
        WARM_UP_STEPS` graphed verify forwards of a chain of ``shape.drafts`` draft tokens (token 0) below a root,
        each cut off after. True once graphed, False when its compile failed, None when the static K/V would not
        fit the device's free memory. No counter of verifies moves."""
        rows, capacity, drafts = shape
        if not self.graphs.dummy_column(cache, rows, capacity):
            return None
        device = next(self.graphs.model.parameters()).device
        queries = 1 + drafts
        fed = torch.zeros(rows, queries, dtype=torch.long, device=device)
        chain = torch.ones(queries, queries, dtype=torch.bool).tril().expand(rows, -1, -1)  # each sees its ancestors
        cache.begin(fed[:, :1], None)  # the dummy column as a request's prompt: a verify records what it feeds
        cache.record(fed[:, :1])
        for _ in range(WARM_UP_STEPS):
            held = cache.get_seq_length()
            positions = torch.arange(held, held + queries, device=device).repeat(rows, 1)
            context = torch.ones(rows, held, dtype=torch.long, device=device)
            tree_mask = tree_attention_mask(context, chain, self.graphs.model.dtype)
            if self._graphed(cache, fed, positions, tree_mask, shape) is None:
                return False
            cache.crop(-queries)  # the dummy cache back to its one column
        return True

    def run(
        self,
        cache: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        tree_mask: torch.Tensor,
        answer: int,
    ) -> torch.Tensor | None:
        """A verify forward of ``input_ids`` ``[B, 1 + k]`` (each row's root, then its ``k`` nodes) at
        ``position_ids`` ``[B, 1 + k]`` under the additive ``tree_mask`` ``[B, 1, 1 + k, C + 1 + k]`` (``C``: the
        columns ``cache`` holds) through its graph (:meth:`shape`; ``answer``: the most tokens a row may still
        take). Returns the logits ``[B, 1 + k, V]`` (fp32, a copy), the cache holding its ``C`` columns, then the
        root's and the nodes' (right after them the padding nodes', which the caller drops with its rejected
        nodes), the fed tokens recorded; the layers padded to the rows' bucket (copies of the last row, which
        the caller's column selection keeps for the next graphed verify, so the static buffers keep their shape
        and address). None when the forward is the caller's to run eagerly (counted in ``eager_verifies``): the
        cache is then growing (no longer static) with its real rows only."""
        rows, queries = input_ids.shape
        shape = self.shape(cache, rows, queries - 1, answer)
        logits = None if shape is None else self._graphed(cache, input_ids, position_ids, tree_mask, shape)
        if logits is None:
            self.eager_verifies += 1
            if isinstance(cache, ChunkReuseCache):
                if cache.padding_rows:
                    cache.pad_batch(rows)  # the real rows only
                cache.set_max_cache_len(None)  # the eager forward's 4D mask covers the held columns, not a capacity
            return None
        self.graphed_verifies += 1
        return logits

    def _graphed(
        self,
        cache: ChunkReuseCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        tree_mask: torch.Tensor,
        shape: VerifyShape,
    ) -> torch.Tensor | None:
        """:meth:`run` through the graph of ``shape``; None (the shape failed, logged; the cache back to its real
        rows) when its first run raised."""
        bucket, capacity, drafts = shape
        rows, queries = input_ids.shape
        if cache.max_cache_len != capacity:
            self.graphs.adopt(cache)  # the static buffers of the cache before it: the graph replays, no re-record
            cache.set_max_cache_len(capacity)
        cache.pad_batch(bucket)
        extra = 1 + drafts - queries
        fed = pad_rows(torch.cat([input_ids, input_ids[:, :1].expand(rows, extra)], dim=1), bucket)
        positions = pad_rows(torch.cat([position_ids, position_ids[:, :1].expand(rows, extra)], dim=1), bucket)
        held = tree_mask.shape[-1] - queries
        mask = tree_mask.new_full((rows, 1, 1 + drafts, capacity), torch.finfo(tree_mask.dtype).min)
        mask[:, :, :queries, : held + queries] = tree_mask
        mask[:, :, queries:, : held + 1] = tree_mask[:, :, :1, : held + 1]  # padding nodes: the root's columns
        mask = pad_rows(mask, bucket)  # outside inference mode, as every input: a padded batch keeps the guards

        def graphed_forward() -> torch.Tensor:
            with torch.inference_mode():
                out = self.graphs._graph()(
                    input_ids=fed,
                    position_ids=positions,
                    attention_mask=mask,
                    use_cache=True,
                    logits_to_keep=1 + drafts,
                    **{CACHE_ARGUMENT: cache},
                )
                return out.logits[:rows, :queries].to(torch.float32, copy=True)

        logits = self.graphs.guarded(shape, self.shapes, self.failed, cache, input_ids.device, graphed_forward)
        if logits is None:
            return None
        cache.record(fed[:rows])
        return logits

    def stats(self) -> dict[str, int]:
        """Counters for ``cache_stats()`` (prefixed ``graph_`` there): verify forwards each way, shapes graphed,
        failed and warmed up."""
        return {
            "graphed_verifies": self.graphed_verifies,
            "eager_verifies": self.eager_verifies,
            "verify_shapes": len(self.shapes),
            "failed_verify_shapes": len(self.failed),
            "warmed_verify_shapes": len(self.warmed),
        }
