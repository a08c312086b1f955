"""Stage 8, speculative part: tree verification, the target's side of a draft round, called by the runner
(:class:`~kvboost_hf.hf.decode.DecodeLoop`) through a :class:`TreeVerifier`.

The verifier asks its :class:`~kvboost_hf.hf.speculative.Drafter` what to draft (:meth:`Drafter.tree_sizes
<kvboost_hf.hf.speculative.Drafter.tree_sizes>`: whether a forward verifies trees and how large they are), builds
the target forward that verifies every row's tree (a decode step's, :meth:`TreeVerifier.step`, or the prompt
forward's, :meth:`TreeVerifier.prompt_queries`), then walks each row down its tree with the row's own choices
(:meth:`TreeVerifier.verify`) and keeps only the accepted paths' columns in both caches.

Invariants: a row takes its own choice at the root, then at the child holding that choice, and so on (plus one more
token), never past its budget or an end token, so a draft never changes a row's tokens; after :meth:`verify` both
caches hold, per row, the columns up to its root and its accepted path (right-aligned, the freed columns masked left
padding), and :class:`Verified` carries the batch's matching 2D mask and last positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvboost_hf.hf.cache import ChunkReuseCache, keep_cache_columns, select_columns
from kvboost_hf.hf.rows import DecodeRow, DraftRound, RowOutput, Sampled, TokenLogprob
from kvboost_hf.hf.sampling import choose_tokens, greedy_tokens
from kvboost_hf.hf.speculative import Drafter, DraftTree, tree_attention_mask
from kvboost_hf.hf.transfer import to_device

#: A row's walk down its tree: the accepted nodes (their columns stay), the tokens taken (the target's own choices:
#: one per accepted node, plus one) and the round (None for a row that does not speculate).
Walk = tuple[list[int], list[int], DraftRound | None]

#: The runner's target forward: ``(input_ids, position_ids, keep, attention_mask) -> logits [B, keep, V]`` (fp32).
TargetForward = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verified:
    """A verify forward's result: each running row's output (in the order of the rows), and the batch's 2D attention
    mask ``[B, C]`` and last positions ``[B]`` after the accepted paths (the runner's new ones)."""

    outputs: list[RowOutput]
    mask: torch.Tensor
    positions: torch.Tensor


class TreeVerifier:
    """Verifies the draft trees of one runner's rows.

    Args:
        draft: the runner's drafter (its cache follows the target cache's layout, see :class:`Drafter`).
        pad_token_id: the token fed for a row with nothing to feed the draft (its column is dropped).
        dtype: the target's dtype (its additive tree masks).
        position_limit: the target's length-dependent RoPE limit (:func:`~kvboost_hf.reuse.rope.exact_reuse_length`;
            None: none): a row at or below it drafts no deeper than it, as transformers takes the factors from a
            forward's largest position (a tree past it would switch the queries of the tokens before it).
    """

    def __init__(
        self, draft: Drafter, pad_token_id: int, dtype: torch.dtype, position_limit: int | None = None
    ) -> None:
        self.draft = draft
        self.pad_token_id = pad_token_id
        self.dtype = dtype
        self.position_limit = position_limit

    def tree_sizes(self, rows: Sequence[DecodeRow]) -> list[int] | None:
        """Nodes per tree level of the next round for ``rows``, or None when the next forward verifies no tree (the
        drafter's policy, :meth:`~kvboost_hf.hf.speculative.Drafter.tree_sizes`, on each row's tokens left, capped
        so that no tree of a row at or below :attr:`position_limit` reaches past it)."""
        return self.draft.tree_sizes([self._tokens_left(row) for row in rows])

    def _tokens_left(self, row: DecodeRow) -> int:
        """``row``'s tokens left, at most one more than the tree depth that keeps its positions within the limit: its
        root sits at ``context_length - 1`` and a tree ``d`` deep reaches ``context_length + d - 1``."""
        limit = self.position_limit
        if limit is None or row.context_length > limit:
            return row.tokens_left
        return min(row.tokens_left, limit - row.context_length + 1)

    def prompt_queries(
        self,
        rows: Sequence[DecodeRow],
        cache: ChunkReuseCache | DynamicCache,
        inputs: dict[str, Any],
        mask: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_starts: tuple[int, ...],
    ) -> tuple[dict[str, Any], list[DraftTree] | None]:
        """The prompt forward's inputs (``inputs``: :func:`~kvboost_hf.hf.prefill.forward_inputs` through the target
        ``cache`` of the left-padded prompts ``input_ids`` with 2D ``mask`` and ``position_ids``) with each row's
        first tree appended as queries, and the trees; unchanged and None when no tree is verified there (the
        drafter's policy says none, or the forward is a sparse repair forward, whose K/V are scattered to the
        prompt's own columns). The draft then prefills the prompts (its cache built with ``segment_starts``) and
        proposes each row's tree below its last prompt token, so the prompt forward verifies it: one target forward
        fewer per generation, the draft's prefill counted in the time to first token. ``rows``: the prompts' rows
        (the first of a repeated prompt drafts for all)."""
        sparse = isinstance(cache, ChunkReuseCache) and cache.expects_sparse_forward
        sizes = None if sparse else self.tree_sizes(rows)
        if sizes is None:
            return inputs, None
        first, roots = self.draft.prefill(input_ids, mask, position_ids, segment_starts), position_ids[:, -1]
        trees = self.draft.expand(first, mask, roots, sizes, lambda i, lg, d: rows[i].draft_scores(lg, d))
        return _with_tree_queries(inputs, mask, trees, roots, self.dtype), trees

    def step(
        self,
        rows: Sequence[DecodeRow],
        cache: ChunkReuseCache | DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        sizes: Sequence[int],
        forward: TargetForward,
    ) -> Verified:
        """One speculative decode step: draft a tree of ``sizes`` nodes per level (a chain without a tree budget)
        below each row's last token, verify every row's tree in one target forward (``forward``), and :meth:`verify`.
        ``mask`` ``[B, C]`` and ``positions`` ``[B]`` are the runner's before the step.

        The forward is timed into the drafter's :class:`~kvboost_hf.hf.speculative.VerifyCosts` (seconds of host
        time, for the adaptive tree budget) from its call until its greedy choices reach the host: that transfer,
        the step's one wait for the device, ends only once the forward ran, so the time covers the device's work
        with no synchronisation of its own (the choices' argmax and copy included)."""
        draft = self.draft
        last = to_device([[row.tokens[-1]] for row in rows], mask.device)
        trees = draft.propose(last, mask, positions, sizes, lambda i, lg, d: rows[i].draft_scores(lg, d))
        nodes = sum(sizes)
        fed = torch.tensor([[row.tokens[-1], *tree.tokens] for row, tree in zip(rows, trees, strict=True)])
        visible = torch.zeros(len(rows), nodes + 1, nodes + 1, dtype=torch.bool)
        visible[:, :, 0] = True  # every query sees the root
        for row, tree in enumerate(trees):
            visible[row, 1:, 1:] = tree.sees()
        depths = to_device([[0, *tree.depths] for tree in trees], mask.device)
        tree_mask = tree_attention_mask(mask, visible, self.dtype)
        started = time.perf_counter()
        logits = forward(fed.to(mask.device), positions[:, None] + 1 + depths, nodes + 1, tree_mask)
        greedy = greedy_tokens(logits).tolist()  # waits for the forward: the timed interval ends after it
        draft.costs.add(len(rows) * (nodes + 1), time.perf_counter() - started)
        root_mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        return self.verify(rows, cache, trees, logits, root_mask, positions + 1, greedy)

    def verify(
        self,
        rows: Sequence[DecodeRow],
        cache: ChunkReuseCache | DynamicCache,
        trees: list[DraftTree],
        logits: torch.Tensor,
        root_mask: torch.Tensor,
        root_positions: torch.Tensor,
        greedy: list[list[int]] | None = None,
    ) -> Verified:
        """Each row's tokens from a verify forward's logits ``[B, 1 + nodes, V]`` (its root's, then each node's);
        keeps only the accepted paths' columns in the target ``cache`` and the draft's. Layout before: ``root_mask``
        ``[B, C]`` covers the columns up to each row's root (the last; at ``root_positions`` ``[B]``), then the
        tree's nodes in both caches (the draft's: each tree's first ``fed`` nodes). ``greedy``: the logits' argmax
        ``[B][1 + nodes]`` on the host when the caller has it (None: taken here, in one transfer)."""
        if greedy is None:
            greedy = greedy_tokens(logits).tolist()  # every plain greedy row's choices, in one transfer
        walks = walk(rows, logits, trees, greedy)
        now = time.perf_counter()
        kept = [path for path, _, _ in walks]
        base = root_mask.shape[1]
        self._keep_draft_paths(trees, kept, root_mask, root_positions)
        target_columns = [[*range(base), *(base + node for node in path)] for path in kept]
        keep_cache_columns(cache, target_columns)
        nodes = len(trees[0].tokens)
        mask = select_columns(torch.cat([root_mask, root_mask.new_ones(len(trees), nodes)], dim=1),
                              target_columns, dim=1)  # fmt: skip
        positions = root_positions + to_device([len(path) for path in kept], root_positions.device)
        logprobs = path_logprobs(rows, logits, walks)
        outputs = [
            RowOutput(row, tuple(tokens), found, now, draft)
            for row, (_, tokens, draft), found in zip(rows, walks, logprobs, strict=True)
        ]
        return Verified(outputs, mask, positions)

    def _keep_draft_paths(
        self, trees: list[DraftTree], kept: list[list[int]], root_mask: torch.Tensor, root_positions: torch.Tensor
    ) -> None:
        """Reduce the draft's cache to each row's columns up to its root and its kept path, in the target cache's
        layout (see :meth:`verify`).

        The draft fed each tree's first ``fed`` nodes; a kept path that ends on a later node is fed to it now (one
        forward; rows without one feed a placeholder that is dropped)."""
        draft = self.draft
        assert draft.cache is not None, "the draft's prefill ran"
        rows, base, inner = len(trees), root_mask.shape[1], trees[0].fed
        fed_paths = [[node for node in path if node < inner] for path in kept]
        columns = [[*range(base), *(base + node for node in path)] for path in fed_paths]
        keep_cache_columns(draft.cache, columns)
        width = max(len(c) for c in columns)
        mask = select_columns(torch.cat([root_mask, root_mask.new_ones(rows, inner)], dim=1), columns, dim=1)
        leaves = [path[-1] if path and path[-1] >= inner else None for path in kept]
        if all(leaf is None for leaf in leaves):
            return
        tokens = [
            [tree.tokens[leaf] if leaf is not None else self.pad_token_id]
            for tree, leaf in zip(trees, leaves, strict=True)
        ]
        depths = [[tree.depths[leaf] if leaf is not None else 1] for tree, leaf in zip(trees, leaves, strict=True)]
        positions = root_positions[:, None] + to_device(depths, root_positions.device)
        draft.forward(to_device(tokens, root_mask.device), torch.cat([mask, mask.new_ones(rows, 1)], dim=1),
                      positions)  # fmt: skip
        final = [[*range(width - len(c), width), *([width] if leaf is not None else [])]
                 for c, leaf in zip(columns, leaves, strict=True)]  # fmt: skip
        keep_cache_columns(draft.cache, final, base + max(len(path) for path in kept))


def walk(
    rows: Sequence[DecodeRow], logits: torch.Tensor, trees: Sequence[DraftTree], greedy: Sequence[Sequence[int]]
) -> list[Walk]:
    """Walk each row down its tree with the verify forward's logits ``[B, 1 + nodes, V]`` (the root's, then each
    node's; ``greedy``: their argmax, the choice of a plain greedy row): its own choice at the root, then at the child
    holding that choice, and so on until no child holds it, its budget is spent or it chose an end token (a row that
    does not speculate takes the root's choice only). The rows walk in step: at each depth the rows that choose with
    their processors and generators choose together (:func:`~kvboost_hf.hf.sampling.choose_tokens`: one wait on the
    device per depth, not two per row and depth), each from its own generator in its own order. Returns per row the
    tree nodes whose columns stay (every taken token's but the last: the accepted nodes), the taken tokens (one of
    the target's own plus the accepted ones) and the round (None for a row that does not speculate)."""
    paths: list[list[int]] = [[] for _ in rows]
    tokens: list[list[int]] = [[] for _ in rows]
    nodes = [-1] * len(rows)
    limited = [False] * len(rows)
    walking = list(range(len(rows)))
    while walking:
        choosing = [i for i in walking if not rows[i].plain_greedy]
        chosen: dict[int, int] = {i: greedy[i][nodes[i] + 1] for i in walking if rows[i].plain_greedy}
        if choosing:
            scores = torch.cat([rows[i].processed(logits[i, nodes[i] + 1][None], tokens[i]) for i in choosing])
            picks = choose_tokens(
                scores, [rows[i].request.sampling for i in choosing], [rows[i].generator for i in choosing]
            )
            chosen.update(zip(choosing, picks, strict=True))
        still = []
        for i in walking:
            row, token = rows[i], chosen[i]
            tokens[i].append(token)
            limited[i] = token in row.end_ids or len(tokens[i]) >= row.tokens_left
            child = trees[i].child(nodes[i], token) if row.speculates and not limited[i] else None
            if child is not None:
                paths[i].append(child)
                nodes[i] = child
                still.append(i)
        walking = still
    return [
        (
            paths[i],
            tokens[i],
            None
            if not row.speculates
            else DraftRound(len(trees[i].tokens), len(paths[i]), not limited[i] and trees[i].has_children(nodes[i])),
        )
        for i, row in enumerate(rows)
    ]


def path_logprobs(
    rows: Sequence[DecodeRow], logits: torch.Tensor, walks: Sequence[Walk]
) -> list[tuple[TokenLogprob, ...]]:
    """Per row, the log-probabilities of the tokens it took down its tree (``walks``, see :func:`walk`; none for a
    row that asked for none), from the verify logits ``[B, 1 + nodes, V]`` of its root and each kept node, computed
    in one pass."""
    picks = [
        (i, column, token)
        for i, (path, tokens, _) in enumerate(walks)
        if rows[i].request.top_logprobs is not None
        for column, token in zip([0, *(node + 1 for node in path)], tokens, strict=True)
    ]
    per_row: list[list[TokenLogprob]] = [[] for _ in walks]
    if picks:
        chosen_rows, columns, tokens = zip(*picks, strict=True)
        picked = logits[list(chosen_rows), list(columns)]
        sampled = Sampled([rows[i] for i in chosen_rows], picked, to_device(tokens, logits.device))
        found = sampled.outputs(sampled.packed.tolist())
        for i, output in zip(chosen_rows, found, strict=True):
            per_row[i] += output.logprobs
    return [tuple(entries) for entries in per_row]


def _with_tree_queries(
    inputs: dict[str, Any], mask: torch.Tensor, trees: list[DraftTree], root_positions: torch.Tensor, dtype: torch.dtype
) -> dict[str, Any]:
    """Dense prompt forward inputs (a suffix of the prompt after the cached columns; ``mask`` ``[B, C]``: the whole
    prompt's 2D mask) with every row's tree nodes appended as queries: the suffix stays causal over the prompt's
    columns, each node sees the whole prompt and its ancestors, at position ``root_positions + depth``; logits are
    kept for the last prompt token and every node."""
    suffix = inputs["input_ids"]
    rows, length = suffix.shape
    nodes = len(trees[0].tokens)
    cached = mask.shape[1] - length
    valid = mask[:, cached:].bool().cpu()
    visible = torch.zeros(rows, length + nodes, length + nodes, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    visible[:, :length, :length] = causal & (valid[:, None, :] | torch.eye(length, dtype=torch.bool))
    visible[:, length:, :length] = valid[:, None, :]
    visible[:, length:, length:] = torch.stack([tree.sees() for tree in trees])
    depths = to_device([tree.depths for tree in trees], mask.device)
    positions = inputs["position_ids"]  # the suffix's (the prefill always passes positions)
    tokens = to_device([tree.tokens for tree in trees], mask.device)
    return {
        **inputs,
        "input_ids": torch.cat([suffix, tokens], dim=1),
        "position_ids": torch.cat([positions, root_positions[:, None] + depths], dim=1),
        "attention_mask": tree_attention_mask(mask[:, :cached], visible, dtype),
        "logits_to_keep": 1 + nodes,
    }
