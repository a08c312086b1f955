"""Tree speculation in the decode loop: a draft tree per row, verified in one target forward, exact output."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_model, noisy_copy
from helpers import chi_square, finish, new_loop, prefill, reuse_caches
from hypothesis import given
from hypothesis import strategies as st

from kvboost_hf import ChunkStore, SamplingConfig
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest
from kvboost_hf.hf.speculative import DraftConfig, Drafter, DraftTree, VerifyCosts, acceptance_by_depth
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(9)
    return [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (19, 7, 26)]


def decode(model, requests, settings=None, draft=None, store=None) -> DecodeLoop:
    drafter = None
    if settings is not None:
        draft_cache = reuse_caches(store, draft, adapter=False)
        drafter = Drafter(draft, settings, draft_cache)
    new_cache = reuse_caches(store, model, adapter=False)
    loop = new_loop(model, new_cache, draft=drafter)
    prefill(loop, requests)
    return finish(loop)


def test_draft_tree_structure():
    tree = DraftTree()
    for token, parent in [(5, -1), (6, -1), (7, 0), (8, 0), (9, 1), (10, 2)]:
        tree.add(token, parent)
    assert tree.depths == [1, 1, 2, 2, 2, 3]
    assert tree.child(-1, 6) == 1 and tree.child(0, 8) == 3 and tree.child(1, 7) is None
    assert tree.path(5) == [0, 2, 5] and tree.path(-1) == []
    sees = tree.sees()
    assert sees[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert sees[4].nonzero().flatten().tolist() == [1, 4]
    assert tree.has_children(0) and not tree.has_children(5)


def test_the_drafters_policy_drafts_only_for_rows_that_can_take_two_tokens(target):
    """Drafter.tree_sizes decides whether a forward verifies trees and how large: nothing when no row may take two
    more tokens; else a tree one level shallower than the largest budget (at most num_draft_tokens deep) holding the
    tree budget."""
    chain = Drafter(target, DraftConfig(num_draft_tokens=5))
    assert chain.tree_sizes([]) is None and chain.tree_sizes([1, 1, 0]) is None
    assert chain.tree_sizes([1, 4]) == [1, 1, 1]
    assert chain.tree_sizes([2]) == [1]
    assert chain.tree_sizes([30, 1]) == [1, 1, 1, 1, 1]
    tree = Drafter(target, DraftConfig(num_draft_tokens=5, tree_budget=6, tree_branching=2))
    assert tree.tree_sizes([4, 2]) == [2, 2, 2]
    assert tree.tree_sizes([2]) == [2]  # one level: branching 2 below the root


@given(st.integers(1, 300), st.integers(1, 6), st.integers(1, 12), st.integers(1, 12))
def test_level_sizes_spread_the_budget_over_the_depth(budget, branching, depth, limit):
    settings = DraftConfig(num_draft_tokens=depth, tree_budget=budget, tree_branching=branching)
    sizes = settings.level_sizes(limit)
    deepest = min(depth, limit)
    width = max(1, budget // deepest)
    assert 1 <= len(sizes) <= deepest and sum(sizes) <= budget
    assert sizes[0] == min(branching, width, budget) and max(sizes) <= width
    assert all(size <= branching * previous for previous, size in itertools.pairwise(sizes))
    if len(sizes) < deepest:
        assert sum(sizes) == budget
    assert DraftConfig(num_draft_tokens=depth).level_sizes(limit) == [1] * deepest
    assert DraftConfig(num_draft_tokens=8, tree_budget=16, tree_branching=2).level_sizes(20) == [2] * 8


@pytest.mark.parametrize("budget", [1, 3, 8, 24, 64])
@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_greedy_rows_with_a_tree_equal_decoding_without_a_draft(target, draft, budget, reuse):
    store = ChunkStore() if reuse else None
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=14, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    plain = decode(target, requests)
    settings = DraftConfig(num_draft_tokens=6, tree_budget=budget, tree_branching=3)
    tree = decode(target, requests, settings, draft, store)
    assert [row.tokens for row in tree.rows] == [row.tokens for row in plain.rows]
    assert sum(row.draft_proposed for row in tree.rows) > 0
    if reuse:  # the chunks written back from the compacted cache are exact: a rerun loads them, same tokens
        again = decode(target, requests, settings, draft, store)
        assert again.rows[2].reuse.cached_tokens == 19  # the batch's common stitched columns (a left-padded batch)
        assert [row.tokens for row in again.rows] == [row.tokens for row in plain.rows]


@pytest.mark.parametrize(("budget", "reuse"), [(3, False), (24, True), (64, False)])
def test_global_expansion_gives_rows_their_own_shapes_and_the_same_tokens(budget, reuse):
    """``tree_expansion="global"``: a step may add nodes at any depth it reached (here a sharpened head, so the
    draft is sure at some positions and not at others), so the rows' trees differ in shape (per-row positions and
    fed nodes); greedy rows still equal decoding without a draft."""
    target = make_tiny_model("llama", seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    draft = noisy_copy(target, 0.35, seed=11)
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=14, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    plain = decode(target, requests)
    settings = DraftConfig(num_draft_tokens=6, tree_budget=budget, tree_branching=3, tree_expansion="global")
    drafter = Drafter(draft, settings)
    shapes: list[list[list[int]]] = []
    propose = drafter.propose

    def recording(*args):
        trees = propose(*args)
        shapes.append([tree.depths for tree in trees])
        return trees

    drafter.propose = recording  # type: ignore[method-assign]
    store = ChunkStore() if reuse else None
    new_cache = reuse_caches(store, target, adapter=False)
    loop = new_loop(target, new_cache, draft=drafter)
    prefill(loop, requests)
    finish(loop)
    assert [row.tokens for row in loop.rows] == [row.tokens for row in plain.rows]
    if budget > 6:  # wide enough for a step to reach back: some round's rows were shaped differently
        assert any(len({tuple(depths) for depths in round_}) > 1 for round_ in shapes)


def test_a_wider_tree_takes_more_tokens_per_target_forward(target, draft):
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=24, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    chain = decode(target, requests, DraftConfig(num_draft_tokens=6), draft)
    tree = decode(target, requests, DraftConfig(num_draft_tokens=6, tree_budget=48, tree_branching=4), draft)
    assert [row.tokens for row in tree.rows] == [row.tokens for row in chain.rows]
    accepted = [sum(row.draft_accepted for row in loop.rows) for loop in (chain, tree)]
    assert accepted[1] > accepted[0] and tree.forwards < chain.forwards


def test_seeded_sampling_with_a_tree_draws_what_it_draws_without_a_draft(target, draft):
    sampling = SamplingConfig(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=5)
    requests = [DecodeRequest(prompt_ids=p, max_new_tokens=16, sampling=sampling) for p in prompts()]
    plain = decode(target, requests)
    tree = decode(target, requests, DraftConfig(num_draft_tokens=4, tree_budget=16, tree_branching=4), draft)
    assert [row.tokens for row in tree.rows] == [row.tokens for row in plain.rows]
    assert sum(row.draft_accepted for row in tree.rows) > 0


def test_rows_joining_a_tree_decoding_batch_and_an_early_exit_draft(target):
    """Continuous batching with trees, and the target's own first layer as the draft."""
    settings = DraftConfig(num_draft_tokens=3, early_exit_layers=1, tree_budget=6, tree_branching=2)
    first, *later = prompts()
    greedy = SamplingConfig(temperature=0)
    loop = new_loop(target, draft=Drafter(target, settings))
    prefill(loop, [DecodeRequest(prompt_ids=first, max_new_tokens=12, sampling=greedy)])
    loop.step()
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=10, sampling=greedy) for p in later])
    while not loop.done:
        loop.step()
    plain = decode(target, [DecodeRequest(prompt_ids=p, max_new_tokens=row.request.max_new_tokens, sampling=greedy)
                            for p, row in zip([first, *later], loop.rows, strict=True)])  # fmt: skip
    assert [row.tokens for row in loop.rows] == [row.tokens for row in plain.rows]


def test_streamed_target_with_a_tree_equals_the_resident_target(draft):
    resident = make_tiny_model("llama", seed=0)
    streamed = make_tiny_model("llama", seed=0)
    enable_layer_streaming(streamed, LayerStreamingConfig(num_slots=2, pin_memory=False, device="cpu"))
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=10, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    expected = decode(resident, requests)
    settings = DraftConfig(num_draft_tokens=4, tree_budget=12, tree_branching=3)
    got = decode(streamed, requests, settings, draft)
    assert [row.tokens for row in got.rows] == [row.tokens for row in expected.rows]
    assert got.forwards < expected.forwards


# ---------------------------------------------------------------------------------------------------- counters
TREE = DraftConfig(num_draft_tokens=4, tree_budget=12, tree_branching=3)


@pytest.fixture(scope="module")
def streamed_engines(draft):
    """A streamed target (every layer over 2 slots) with no draft and with a tree draft, one store each."""
    from helpers import word_tokenizer

    from kvboost_hf import KVBoost

    streamed = make_tiny_model("llama", seed=0)
    enable_layer_streaming(streamed, LayerStreamingConfig(num_slots=2, pin_memory=False, device="cpu"))
    plain = KVBoost(streamed, word_tokenizer(), chunking=16)
    drafted = KVBoost(streamed, word_tokenizer(), chunking=16, draft_model=draft)
    drafted.draft_settings = TREE
    return plain, drafted


def test_tree_generation_counters_add_up(streamed_engines):
    """Greedy, one row: each target forward yields one token of its own plus the draft tokens it accepted; every
    forward, the prompt's included (it verifies the first tree), verified at most ``tree_budget`` nodes; the
    engine's totals and bytes follow."""
    from helpers import words

    plain_engine, engine = streamed_engines
    prompt = words(21, 30)
    plain = plain_engine.generate(prompt, max_new_tokens=20)
    before = engine.cache_stats()
    result = engine.generate(prompt, max_new_tokens=20)
    after = engine.cache_stats()
    assert result.output_ids == plain.output_ids
    assert result.generated_tokens == result.target_forwards + result.draft_tokens_accepted
    assert result.verify_forwards == result.target_forwards
    assert 0 < result.draft_tokens_proposed <= TREE.tree_budget * result.verify_forwards
    assert result.draft_tokens_accepted_per_verify == result.draft_tokens_accepted / result.verify_forwards > 0
    assert result.streamed_bytes_per_token == result.streamed_bytes / result.generated_tokens
    assert result.streamed_bytes < plain.streamed_bytes  # fewer target forwards stream fewer layers
    for name in ("generated_tokens", "target_forwards", "verify_forwards", "draft_tokens_proposed",
                 "draft_tokens_accepted", "streamed_bytes"):  # fmt: skip
        assert after[name] - before[name] == getattr(result, name), name
    assert after["streamed_bytes_per_token"] == after["streamed_bytes"] / after["generated_tokens"]
    assert after["draft_tokens_accepted_per_verify"] == after["draft_tokens_accepted"] / after["verify_forwards"]
    assert plain.target_forwards == plain.generated_tokens and plain.verify_forwards == 0
    assert plain.draft_tokens_proposed == 0 and plain.draft_tokens_accepted_per_verify is None
    assert plain_engine.cache_stats()["verify_forwards"] == 0


def test_batch_counters_bound_the_verified_nodes(target, draft):
    """A batch: each verify forward checks at most ``tree_budget`` nodes per running row; streamed bytes are
    None on a resident target."""
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=12, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    loop = decode(target, requests, TREE, draft)
    proposed = sum(row.draft_proposed for row in loop.rows)
    assert 0 < proposed <= len(requests) * TREE.tree_budget * loop.verify_forwards
    assert loop.verify_forwards == loop.forwards and loop.streamed_bytes is None


@pytest.mark.parametrize("ending", ["length", "end-token"])
def test_a_row_ending_on_a_proposed_token_counts_it_as_the_forwards_own(target, ending):
    """An identical draft (every proposal accepted): a row that finishes on a proposed token (its budget, or an end
    token) does not count that token as accepted, and no draft is made for a row's last token; so generated
    tokens = target forwards + accepted draft tokens exactly."""
    prompt = prompts()[0]
    plain = (
        decode(target, [DecodeRequest(prompt_ids=prompt, max_new_tokens=12, sampling=SamplingConfig(temperature=0))])
        .rows[0]
        .tokens
    )
    end = plain[4] if ending == "end-token" else None
    assert end is None or end not in plain[:4]
    request = DecodeRequest(prompt_ids=prompt, max_new_tokens=7, sampling=SamplingConfig(temperature=0))
    loop = new_loop(target, draft=Drafter(target, DraftConfig(num_draft_tokens=4)))
    prefill(loop, [request], eos={end} if end is not None else set())
    finish(loop)
    (row,) = loop.rows
    assert row.tokens == plain[: len(row.tokens)] and len(row.tokens) == (5 if end is not None else 7)
    assert len(row.tokens) == loop.forwards + row.draft_accepted
    assert row.draft_rounds[-1][1] is False  # no round ended on a miss: the identical draft proposes the target's
    assert loop.verify_forwards == len(row.draft_rounds)


@pytest.mark.parametrize("max_new_tokens", [10, 12])
def test_the_prompt_forward_verifies_the_first_draft(target, max_new_tokens):
    """An identical draft, a chain of 4: every forward, the prompt's included, yields 5 tokens, so ``N`` tokens take
    ceil(N / 5) target forwards (without the fold the prompt forward yielded one: 1 + ceil((N - 1) / 5), one
    more), with the tokens of decoding without a draft."""
    prompt = prompts()[0]
    request = DecodeRequest(prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0))
    plain = decode(target, [request])
    loop = decode(target, [request], DraftConfig(num_draft_tokens=4), target)
    assert loop.rows[0].tokens == plain.rows[0].tokens
    assert loop.forwards == -(-max_new_tokens // 5) == 1 + -(-(max_new_tokens - 1) // 5) - 1
    assert loop.verify_forwards == loop.forwards and loop.rows[0].draft_rounds[0] == (4, False)


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_rows_of_one_prompt_share_the_folded_first_tree(target, draft, reuse):
    """Rows with one prompt (prefilled as one row, then repeated) each verify the first tree with their own
    choices: greedy and two seeded rows draw what they draw without a draft."""
    prompt = prompts()[2]
    samplings = [SamplingConfig(temperature=0), *(SamplingConfig(temperature=0.9, seed=seed) for seed in (1, 2))]
    requests = [DecodeRequest(prompt_ids=prompt, max_new_tokens=12, sampling=sampling) for sampling in samplings]
    plain = decode(target, requests)
    store = ChunkStore() if reuse else None
    new_cache = reuse_caches(store, target, adapter=False)
    drafter = Drafter(draft, DraftConfig(num_draft_tokens=4, tree_budget=12, tree_branching=3))
    loop = new_loop(target, new_cache, draft=drafter)
    prefill(loop, requests)
    assert loop.forwards == loop.verify_forwards == 1 and all(len(row.draft_rounds) == 1 for row in loop.rows)
    while not loop.done:
        loop.step()
    assert [row.tokens for row in loop.rows] == [row.tokens for row in plain.rows]


def test_server_metrics_expose_the_tree_counters(streamed_engines):
    from helpers import scrape_metrics, words

    _, engine = streamed_engines
    stats, samples = scrape_metrics(engine, words(22, 30))
    assert samples["kvboost_verify_forwards_total"] == stats["verify_forwards"] > 0
    for gauge in ("draft_tokens_accepted_per_verify", "streamed_bytes_per_token"):
        assert samples[f"kvboost_{gauge}"] == pytest.approx(stats[gauge]) and stats[gauge] > 0


def test_acceptance_by_depth_counts_the_rounds_that_reached_each_depth():
    rounds = [(2, True), (0, True), (3, False), (1, False)]
    assert acceptance_by_depth(rounds) == [3 / 4, 2 / 2, 1 / 2]
    assert acceptance_by_depth([]) == []


@pytest.mark.parametrize(("budget", "expansion"), [(0, "level"), (12, "level"), (12, "global")],
                         ids=["chain", "tree", "global-tree"])  # fmt: skip
def test_every_expanded_node_starts_with_the_drafts_own_choice(target, draft, budget, expansion):
    """Within a round (the draft's tree-masked forwards) and across rounds (its cache after each compaction), the
    draft sees exactly the node's sequence: the first child of every expanded node (the best of its siblings) is the
    draft's argmax after the row's tokens and the node's path, computed from scratch. Round records add up."""
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=20, sampling=SamplingConfig(temperature=0)) for p in prompts()
    ]
    drafter = Drafter(draft, DraftConfig(num_draft_tokens=5, tree_budget=budget, tree_expansion=expansion))
    loop = new_loop(target, draft=drafter)
    assert loop.draft is not None
    propose, seen = loop.draft.propose, []

    def recording(*args, **kwargs):
        trees = propose(*args, **kwargs)
        for row, tree in zip(loop.running, trees, strict=True):
            for node in [-1, *range(len(tree.tokens))]:
                first_child = next((j for j, parent in enumerate(tree.parents) if parent == node), None)
                if first_child is not None:
                    path = [tree.tokens[j] for j in tree.path(node)]
                    seen.append(([*row.request.prompt_ids, *row.tokens, *path], tree.tokens[first_child]))
        return trees

    loop.draft.propose = recording  # type: ignore[method-assign]
    prefill(loop, requests)
    finish(loop)
    assert len(seen) > 30
    lengths = torch.tensor([len(sequence) for sequence, _ in seen])
    padded = torch.zeros(len(seen), int(lengths.max()), dtype=torch.long)  # right padding: causal, so harmless
    for index, (sequence, _) in enumerate(seen):
        padded[index, : len(sequence)] = torch.tensor(sequence)
    with torch.no_grad():
        logits = draft(padded).logits[torch.arange(len(seen)), lengths - 1]
    assert logits.argmax(-1).tolist() == [proposed for _, proposed in seen]
    for row in loop.rows:
        assert sum(kept for kept, _ in row.draft_rounds) == row.draft_accepted
        assert sum(refused for _, refused in row.draft_rounds) == row.draft_rejected
    assert max(len(row.draft_rounds) for row in loop.rows) == loop.verify_forwards  # the longest row: every round


# ---------------------------------------------------------------------------------------------------- distribution
# The multi-draft rule implemented (DecodeLoop._verify): at each tree node the row draws its token from the
# target's distribution there (its processors, its seeded generator) and descends into the child holding that
# token; the first node with no such child ends the round. Not recursive rejection sampling (SpecInfer/SpecTr): a
# node is kept with the target's probability of its token, and the output distribution is the target's whatever
# the tree. These tests check that on the distributions, not on the code's reasoning.


def sampled_loop(target, draft, prompt, max_new_tokens, settings, seed, temperature=1.0) -> DecodeLoop:
    request = DecodeRequest(
        prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=temperature, seed=seed)
    )
    loop = new_loop(target, draft=Drafter(draft, settings))
    prefill(loop, [request], eos=set())
    return finish(loop)


def next_token_probs(model, sequences: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[N, V]``: the model's next-token distribution after each of ``sequences`` ``[N, L]``."""
    with torch.no_grad():
        return (model(sequences).logits[:, -1] / temperature).softmax(-1)


def test_a_tree_keeps_the_targets_distributionchi_square():
    """The third sampled token (after the prefill's and the first verify's root draw: accepted from the tree or
    drawn after a miss) follows the target's marginal, not the draft's (16 tokens, sharpened heads)."""
    vocab, prompt = 16, [3, 5, 7, 2, 9]
    target, draft = (make_tiny_model("llama", seed=s, vocab_size=vocab, num_hidden_layers=1) for s in (0, 3))
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
        draft.lm_head.weight.mul_(8)

    def third_token_marginal(model) -> torch.Tensor:
        first = next_token_probs(model, torch.tensor([prompt]))[0]
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (t1, t2)
        second = next_token_probs(model, torch.tensor([[*prompt, token] for token in range(vocab)]))  # [t1, t2]
        third = next_token_probs(model, torch.cat([torch.tensor([prompt]).expand(len(pairs), -1), pairs], dim=1))
        weights = first[pairs[:, 0]] * second[pairs[:, 0], pairs[:, 1]]
        return (weights[:, None] * third).sum(0)

    settings = DraftConfig(num_draft_tokens=2, tree_budget=3, tree_branching=3)
    counts, accepted = torch.zeros(vocab, dtype=torch.long), 0
    draws = 150
    for seed in range(draws):
        loop = sampled_loop(target, draft, prompt, 3, settings, seed)
        counts[loop.rows[0].tokens[2]] += 1
        accepted += loop.rows[0].draft_accepted > 0
    assert 0 < accepted < draws  # both the accepted and the missed branch ran
    _, p_target = chi_square(counts, third_token_marginal(target))
    _, p_draft = chi_square(counts, third_token_marginal(draft))
    assert p_target > 1e-3 and p_draft < 1e-6, counts.tolist()


@pytest.mark.parametrize("branching", [2, 4], ids=["partial-tree", "every-continuation"])
def test_the_sampled_output_distribution_is_the_targets_exactly(monkeypatch, branching):
    """Enumerable: vocabulary 4, the first token fixed, the next 3 scripted over all 64 sequences in place of the
    row's draws, each weighted by the probability the loop drew it with (the softmax at the verify forward's node).
    The weights are the exact distribution the loop samples from; each must equal the target's own probability of
    that continuation (a full forward per prefix), through trees with misses (branching 2) and without (4)."""
    import kvboost_hf.hf.rows as rows_module
    import kvboost_hf.hf.verify as verify_module

    vocab, prompt, temperature = 4, [1, 3, 2, 0, 0, 2], 0.7
    target = make_tiny_model("llama", seed=3, vocab_size=vocab, num_hidden_layers=1)
    draft = noisy_copy(target, 0.5, seed=4)
    script: list[int] = []
    weight = [1.0]

    def scripted(scores, params, generator):
        token = script.pop(0)
        weight[0] *= float(torch.softmax(scores.float(), dim=-1)[0, token])
        return token

    def scripted_rows(scores, params, generators):
        return [scripted(scores[row : row + 1], each, generator) for row, (each, generator) in
                enumerate(zip(params, generators, strict=True))]  # fmt: skip

    monkeypatch.setattr(rows_module, "choose_tokens", scripted_rows)  # a plain step's rows at once (sample)
    monkeypatch.setattr(verify_module, "choose_tokens", scripted_rows)  # the rows walking their trees, per depth
    settings = DraftConfig(num_draft_tokens=2, tree_budget=50, tree_branching=branching)
    first = 2
    total = 0.0
    for continuation in itertools.product(range(vocab), repeat=3):
        script[:], weight[0] = [first, *continuation], 1.0
        loop = sampled_loop(target, draft, prompt, 4, settings, seed=0, temperature=temperature)
        assert loop.rows[0].tokens == [first, *continuation] and not script
        sequence = torch.tensor([prompt + loop.rows[0].tokens])
        with torch.no_grad():  # causal: position i's logits are the next-token distribution after sequence[:i + 1]
            probs = (target(sequence).logits[0, len(prompt) - 1 : -1] / temperature).softmax(-1)
        expected = float(probs[torch.arange(4), sequence[0, len(prompt) :]].prod())
        assert weight[0] == pytest.approx(expected, rel=1e-4), continuation
        total += weight[0]
    first_prob = float(next_token_probs(target, torch.tensor([prompt]), temperature)[0, first])
    assert total == pytest.approx(first_prob, rel=1e-4)


def test_tree_benchmark_rows_follow_from_the_counts(tmp_path):
    """``bench speculative --tree-budgets``: the row of one prompt's counts, its report and plot."""
    from kvboost_hf.bench import speculative_tree

    def run(forwards, verifies, streamed, proposed, rounds, tokens=(5, 6, 7, 8, 9, 10, 11, 12)):
        accepted = sum(kept for kept, _ in rounds)
        return {"tokens": list(tokens), "target_forwards": forwards, "verify_forwards": verifies, "draft_forwards": 6,
                "streamed_bytes": streamed, "proposed": proposed, "accepted": accepted, "rounds": rounds,
                "seconds": 0.5}  # fmt: skip

    plain = [run(8, 0, 800, 0, [])]
    row = speculative_tree.summarise([run(3, 2, 300, 10, [(4, True), (1, False)])], plain, 5)
    assert row["tokens_per_target_forward"] == 8 / 3 and row["tokens_per_verify"] == 1 + 5 / 2
    assert row["nodes_per_verify"] == 5 and row["streamed_vs_plain"] == 0.375
    assert row["acceptance_by_depth"] == [1, 1, 1, 1, 0] and row["position_acceptance"] == 5 / 6
    assert row["estimated_gpu_tok_s"]["pcie4_x16"] == pytest.approx(25e9 * 8 / 300)
    assert row["first_difference"] is None
    assert speculative_tree.summarise([run(8, 0, 800, 0, [], tokens=(5, 6, 0, 8))], plain, 0)["first_difference"] == 2
    result = {"streamed_layers": 2, "streamed_mb_per_forward": 1e-4, "draft": "bf16", "tree_depth": 4,
              "tree_branching": 2, "prompts": 1, "max_new_tokens": 8, "model": "tiny", "verify_seconds": {"1": 0.1},
              "verify_ms_per_node": 0.0, "rows": [speculative_tree.summarise(plain, plain, None), row]}  # fmt: skip
    assert speculative_tree.report(result).split("\n")[3].split()[:4] == ["5", "2.67", "3.50", "5.0"]
    speculative_tree.plot(result, tmp_path / "tree.png")
    assert (tmp_path / "tree.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------------- adaptive budget
def timed(fixed: float, per_node: float, nodes=(13, 13, 2, 40)) -> VerifyCosts:
    """Verify forwards timed on an exact line ``fixed + per_node * nodes``."""
    costs = VerifyCosts()
    for count in nodes:
        costs.add(count, fixed + per_node * count)
    return costs


def test_verify_costs_fit_the_fixed_and_the_per_node_cost():
    fixed, per_node = timed(2.0, 1e-3).fit() or (0.0, 0.0)
    assert fixed == pytest.approx(2.0) and per_node == pytest.approx(1e-3)
    assert timed(2.0, 1e-3, nodes=(5, 5, 5)).fit() is None  # one node count: no slope yet
    window = VerifyCosts(window=3)
    for count in (2, 9, 9, 9):
        window.add(count, 1.0)
    assert window.fit() is None  # the 2-node sample left the window: explore again


def test_the_adaptive_budget_follows_the_measured_cost_ratio():
    """Streamed (a 2 s fixed cost, 0.1 ms a node): the largest budget; resident (20 ms fixed, 2 ms a node): a
    quarter of the fixed cost buys 2 nodes a row (1 for 2 rows); explores the cap, then one node, before a fit."""
    settings = DraftConfig(num_draft_tokens=16, tree_budget=256, adaptive_tree_budget=True)
    assert settings.adaptive_budget(timed(2.0, 1e-4), rows=1) == 256
    assert settings.adaptive_budget(timed(0.02, 2e-3), rows=1) == 2
    assert settings.adaptive_budget(timed(0.02, 2e-3), rows=2) == 1
    assert (
        DraftConfig(tree_budget=256, adaptive_tree_budget=True, tree_overhead=2.0).adaptive_budget(
            timed(0.02, 2e-3), rows=1
        )
        == 20
    )
    assert settings.adaptive_budget(timed(0.5, 1e-2), rows=1) == 12
    assert settings.adaptive_budget(timed(1.0, -1e-4), rows=1) == 256  # no measurable per-node cost
    assert settings.adaptive_budget(VerifyCosts(), rows=1) == 256
    assert settings.adaptive_budget(timed(1.0, 0.0, nodes=(257,)), rows=1) == 1
    assert settings.adaptive_budget(timed(1.0, 0.0, nodes=(2, 2)), rows=1) == 256  # one-node rounds only: up again
    with pytest.raises(ValueError, match="tree_budget"):
        DraftConfig(adaptive_tree_budget=True)
    with pytest.raises(ValueError, match="tree_overhead"):
        DraftConfig(tree_budget=8, adaptive_tree_budget=True, tree_overhead=0.0)


class FrozenCosts(VerifyCosts):
    """Fixed timings; the loop's own timed forwards are kept aside in ``added``."""

    def __init__(self, costs: VerifyCosts) -> None:
        super().__init__()
        self.samples, self.added = costs.samples, []

    def add(self, nodes: int, seconds: float) -> None:
        self.added.append((nodes, seconds))


def test_the_loop_uses_and_feeds_the_adaptive_budget(target, draft):
    """Timings that allow 3 nodes a row: every tree holds 3 nodes (the prompt's included), the tokens are plain
    greedy's, and each speculative step hands its timed verify forward (nodes with the root) to the costs."""
    settings = DraftConfig(num_draft_tokens=4, tree_budget=64, tree_branching=3, adaptive_tree_budget=True)
    costs = FrozenCosts(timed(0.03, 2.5e-3))  # 0.25 * 0.03 / 0.0025 = 3 nodes a row
    requests = [DecodeRequest(prompt_ids=prompts()[0], max_new_tokens=12, sampling=SamplingConfig(temperature=0))]
    plain = decode(target, requests)
    loop = new_loop(target, draft=Drafter(draft, settings, costs=costs))
    prefill(loop, requests)
    finish(loop)
    (row,) = loop.rows
    assert row.tokens == plain.rows[0].tokens
    assert row.draft_proposed == 3 * loop.verify_forwards  # 12 tokens: every round had room for 3 levels
    assert len(costs.added) == loop.verify_forwards - 1  # the prompt forward is not timed
    assert all(nodes == 4 and seconds > 0 for nodes, seconds in costs.added)


class DeviceClock:
    """A fake host clock for the verify forwards of ``kvboost_hf.hf.verify``: each read moves it 1 us; a verify
    forward's device work (``fixed + per_node * nodes`` seconds, ``nodes`` counting every row's root and draft
    tokens) passes while the host waits for its greedy choices (their ``tolist()``), as on a GPU, where the forward
    only queues work."""

    def __init__(self, fixed: float, per_node: float) -> None:
        self.now, self.fixed, self.per_node = 0.0, fixed, per_node

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def greedy_tokens(self, logits: torch.Tensor) -> object:
        clock, choices = self, logits.argmax(dim=-1)

        class OnDevice:
            def tolist(self) -> list:
                clock.now += clock.fixed + clock.per_node * choices.numel()
                return choices.tolist()

        return OnDevice()


def test_the_verify_time_spans_the_device_work_without_a_synchronize(target, draft, monkeypatch):
    """A step's verify forward is timed until its choices reach the host, with no ``torch.cuda.synchronize``: the
    timed seconds are the device's (30 ms + 2.5 ms a node) and the adaptive budget follows them: the cap first (44
    nodes and the root: levels of 3, 9, 16, 16), then one node to explore, then 0.25 * 30 / 2.5 = 3 nodes a row;
    the tokens are plain greedy's."""
    import kvboost_hf.hf.verify as verify

    clock = DeviceClock(0.03, 2.5e-3)
    monkeypatch.setattr(verify, "time", clock)
    monkeypatch.setattr(verify, "greedy_tokens", clock.greedy_tokens)
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: synchronized.append(args))
    settings = DraftConfig(num_draft_tokens=4, tree_budget=64, tree_branching=3, adaptive_tree_budget=True)
    requests = [DecodeRequest(prompt_ids=prompts()[0], max_new_tokens=24, sampling=SamplingConfig(temperature=0))]
    loop = new_loop(target, draft=Drafter(draft, settings, costs=VerifyCosts()))
    prefill(loop, requests)
    finish(loop)
    assert loop.rows[0].tokens == decode(target, requests).rows[0].tokens
    samples = list(loop.draft.costs.samples)
    assert [nodes for nodes, _ in samples[:3]] == [45, 2, 4] and len(samples) == loop.verify_forwards - 1
    for nodes, seconds in samples:
        assert seconds == pytest.approx(0.03 + 2.5e-3 * nodes, abs=1e-5)
    assert synchronized == []


def test_server_flags_set_the_adaptive_budget():
    import argparse

    from kvboost_hf.core.settings import settings_from_args
    from kvboost_hf.server.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tree-budget", "128", "--adaptive-tree-budget", "--tree-overhead", "0.5"])
    settings = settings_from_args(DraftConfig, args)
    assert (settings.tree_budget, settings.adaptive_tree_budget, settings.tree_overhead) == (128, True, 0.5)


def test_draft_ranks_place_the_targets_greedy_tokens_among_the_drafts_predictions(target, draft):
    from kvboost_hf.bench import speculative_tree

    prompt = prompts()[0]
    tokens = (
        decode(target, [DecodeRequest(prompt_ids=prompt, max_new_tokens=10, sampling=SamplingConfig(temperature=0))])
        .rows[0]
        .tokens
    )
    own = speculative_tree.draft_ranks(target, target, prompt, tokens)
    assert own["ranks"] == [1] * 10 and all(own["target_agrees"])
    other = speculative_tree.draft_ranks(target, draft, prompt, tokens)
    with torch.no_grad():
        logits = draft(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    order = logits.argsort(-1, descending=True)
    assert other["ranks"] == [int((order[i] == t).nonzero()) + 1 for i, t in enumerate(tokens)]
    assert any(rank > 1 for rank in other["ranks"])


def test_the_engine_keeps_one_verify_record_across_calls(draft):
    """An engine's adaptive drafters share its ``verify_costs``: timed forwards accumulate over calls, and the
    output is the engine's without a draft."""
    from helpers import word_tokenizer, words

    from kvboost_hf import KVBoost

    model = make_tiny_model("llama", seed=0)
    settings = DraftConfig(num_draft_tokens=4, tree_budget=16, tree_branching=3, adaptive_tree_budget=True)
    engine = KVBoost(model, word_tokenizer(), chunking=16, draft_model=draft, draft=settings)
    plain = KVBoost(model, word_tokenizer(), chunking=16)
    first = engine.generate(words(31, 20), max_new_tokens=12)
    timed_once = len(engine.verify_costs.samples)
    second = engine.generate(words(32, 20), max_new_tokens=12)
    assert 0 < timed_once < len(engine.verify_costs.samples)
    assert first.verify_forwards > 1 and second.verify_forwards > 1
    for result, seed in ((first, 31), (second, 32)):
        assert result.output_ids == plain.generate(words(seed, 20), max_new_tokens=12).output_ids
