"""One forward for several batches' new tokens (kvboost_hf/hf/packed.py, and the runner's use of it in
kvboost_hf/hf/decode.py): each part gets the logits and K/V of its own forward, and a scheduler whose batches share
forwards gives transformers' tokens with the cached-token counts of one that does not."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import LENGTH_DEPENDENT, make_tiny_model
from helpers import word_tokenizer, words
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import GREEDY, engine_reference
from transformers import DynamicCache

from kvboost_hf import KVBoost
from kvboost_hf import runner as runner_module
from kvboost_hf.hf import decode as decode_module
from kvboost_hf.hf.decode import DecodeRequest, left_pad
from kvboost_hf.hf.models import forward_read_bytes
from kvboost_hf.hf.packed import ForwardPart, packable, packed_forward
from kvboost_hf.scheduling import PACKED_JOIN_PADDING_CELLS, RequestGroup


def kvboost_model(name: str, **overrides):
    model = make_tiny_model(name, **overrides)
    model.set_attn_implementation("kvboost")
    return model


# the property test's models (built once: hypothesis runs many examples); Mistral's window of 5 columns is shorter
# than most examples' contexts, so its cache returns only the window and the mask starts at an offset
PACKED_MODELS = {"llama": kvboost_model("llama"), "mistral": kvboost_model("mistral", sliding_window=5)}


def padded(lengths, seed: int):
    """Left-padded random prompts of ``lengths``: ``(input_ids, mask, position_ids)`` as the runner builds them."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    return ids, mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def alone(model, cache, part: ForwardPart) -> torch.Tensor:
    """The part's own forward through ``cache``: its rows' last-position logits (fp32)."""
    with torch.inference_mode():
        out = model(input_ids=part.input_ids, attention_mask=part.attention_mask, position_ids=part.position_ids,
                    cache=cache, use_cache=True)  # fmt: skip
    return out.logits[:, -1].float()


def assert_same_kv(cache, reference) -> None:
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys, expected.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, expected.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
def test_a_packed_forward_gives_each_part_the_logits_and_kv_of_its_own_forward(name):
    """Three left-padded rows decoding and a two-row prompt (one row left-padded by 6) prefilled in two chunks of
    8 and 12 columns: each packed forward leaves every cache holding the K/V of the part's own forward, the decode
    rows get their own logits each time and the prompt its last position's once its last chunk ran (the first chunk,
    asking none, gets None; its padding queries see no key and stay finite)."""
    model = kvboost_model(name)
    ids, mask, positions = padded([7, 12, 3], seed=1)
    running = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=running, use_cache=True)
    prompt_ids, prompt_mask, prompt_positions = padded([20, 14], seed=2)
    prompt = DynamicCache()
    last = torch.tensor([[5], [9], [11]])
    for step, (start, stop) in enumerate([(0, 8), (8, 20)]):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
        parts = [
            ForwardPart(running, last + step, positions, mask, logits=True),
            ForwardPart(
                prompt,
                prompt_ids[:, start:stop],
                prompt_positions[:, start:stop],
                prompt_mask[:, :stop],
                logits=stop == 20,
            ),
        ]
        references = [copy.deepcopy(running), copy.deepcopy(prompt)]
        expected = [alone(model, reference, part) for reference, part in zip(references, parts, strict=True)]
        got = packed_forward(model, parts)
        torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
        if stop == 20:
            torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
        else:
            assert got[1] is None
        assert_same_kv(running, references[0])
        assert_same_kv(prompt, references[1])
        assert all(torch.isfinite(layer.values).all() for layer in prompt.layers)


def test_packable_needs_the_kvboost_attention_full_attention_layers_and_plain_caches():
    """Only the ``"kvboost"`` attention carries a packed forward's parts to their caches; sliding-window layers are
    served (Mistral's window of 24), soft-capped attention (Gemma2), a length-dependent RoPE (Phi3's longrope), a
    cache with a context adjustment, an armed sparse repair forward and a static cache each need a forward of their
    own."""
    plain = DynamicCache()
    assert packable(kvboost_model("llama"), [plain, plain])
    assert not packable(make_tiny_model("llama"), [plain, plain])  # sdpa
    assert packable(kvboost_model("mistral"), [plain, plain])
    assert not packable(kvboost_model("gemma2"), [plain, plain])
    adjusted = types.SimpleNamespace(expects_sparse_forward=False, attention_kwargs=lambda: {"adjustment": 1})
    sparse = types.SimpleNamespace(expects_sparse_forward=True, attention_kwargs=dict)
    static = types.SimpleNamespace(max_cache_len=256)  # a graph's cache returns its whole capacity
    assert not packable(kvboost_model("llama"), [plain, adjusted])
    assert not packable(kvboost_model("llama"), [sparse, plain])
    assert not packable(kvboost_model("llama"), [plain, static])
    # a length-dependent RoPE takes its factors from the largest position of the whole packed forward
    assert not packable(kvboost_model("phi3", **LENGTH_DEPENDENT["longrope"][1]), [plain, plain])


def run_join(engine, prompts, arrive_at, monkeypatch, *, pack: bool):
    """Step a scheduler (token budget 6, join padding limit 20, ``pack_forwards=pack``) over ``prompts`` arriving at
    ``arrive_at``; returns the rows and the parts of each packed forward."""
    packed_parts: list[int] = []

    def counted(model, parts):
        packed_parts.append(len(parts))
        return packed_forward(model, parts)

    monkeypatch.setattr(runner_module, "packed_forward", counted)
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=6, pack_forwards=pack)
    core.scheduler.join_padding_limit = 20
    rows = engine.factories.new_rows(
        [DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=8, sampling=GREEDY) for p in prompts]
    )
    groups = [RequestGroup([row]) for row in rows]
    for step in range(200):
        for group, at in zip(groups, arrive_at, strict=True):
            if at == step:
                core.scheduler.add(group)
        core.step()
        if core.scheduler.idle and step >= max(arrive_at):
            break
    assert core.scheduler.idle
    return rows, packed_parts


@pytest.mark.parametrize(("name", "overrides"), [("llama", {}), ("mistral", {"sliding_window": 12})], ids=str)
def test_batches_sharing_forwards_give_generates_tokens_and_the_cached_counts_of_separate_forwards(
    monkeypatch, name, overrides
):
    """Two short rows decode; a 60-word prompt whose first 16 tokens are stored joins at step 2 in a batch of its own
    (it would pad them past the limit) and is prefilled 4-6 columns per step. From its first chunk on, the running
    rows' decode step and its chunk share one forward, and once it decodes the two batches' steps do. Every row's
    tokens equal transformers' greedy ones and the cached tokens those of the same run with packing off (a forward
    per batch step and per chunk, none packed); also for a model whose layers attend a 12-token sliding window."""
    engine = KVBoost(kvboost_model(name, **overrides), word_tokenizer(), chunking=8)
    head = words(70, 16)
    prompts = [words(90, 4), words(91, 5), f"{head} {words(92, 44)}"]
    expected = [engine_reference(engine, prompt, 8).tokens for prompt in prompts]
    runs = {}
    for pack in (False, True):
        engine.store.clear()
        engine.warm(head)
        runs[pack] = run_join(engine, prompts, [0, 0, 2], monkeypatch, pack=pack)
    (apart_rows, apart_parts), (packed_rows, packed_parts) = runs[False], runs[True]
    assert apart_parts == [] and len(packed_parts) >= 5 and set(packed_parts) == {2}
    for rows in (apart_rows, packed_rows):
        assert [row.tokens for row in rows] == expected
    assert [row.reuse.cached_tokens for row in packed_rows] == [row.reuse.cached_tokens for row in apart_rows]
    assert packed_rows[2].reuse.cached_tokens >= 8


def test_a_shared_forward_that_raises_fails_every_batch_in_it_and_the_scheduler_goes_on(monkeypatch):
    """The running rows' batch and a joining prompt's batch share a forward that raises: both batches' groups get
    the error, the scheduler drops them, and a request queued after runs to transformers' tokens."""
    engine = KVBoost(kvboost_model("llama"), word_tokenizer(), chunking=8)
    calls = []

    def explode(model, parts):
        calls.append(len(parts))
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner_module, "packed_forward", explode)
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=6)
    core.scheduler.join_padding_limit = 20
    prompts = [words(90, 4), words(92, 60)]
    failures: list[BaseException] = []
    rows = engine.factories.new_rows(
        [DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=8, sampling=GREEDY) for p in prompts]
    )
    core.scheduler.add(RequestGroup([rows[0]], on_fail=failures.append))
    core.step()
    core.scheduler.add(RequestGroup([rows[1]], on_fail=failures.append))
    for _ in range(4):
        core.step()
    assert calls == [2] and [str(error) for error in failures] == ["device lost", "device lost"]
    assert core.scheduler.running == []
    monkeypatch.setattr(runner_module, "packed_forward", packed_forward)
    late = DecodeRequest(prompt_ids=engine.encode(words(93, 3)), max_new_tokens=4, sampling=GREEDY)
    rows = engine.factories.new_rows([late])
    core.scheduler.add(RequestGroup(rows))
    core.run()
    assert rows[0].tokens == engine_reference(engine, words(93, 3), 4).tokens


def test_where_batches_share_forwards_a_join_may_add_only_a_few_slack_columns_of_padding():
    """A batch of its own costs one more forward per step, unless the batches' steps are packed into one: then the
    engine's scheduler lets a group join a running batch only while it adds at most PACKED_JOIN_PADDING_CELLS cells
    of padding. With the sdpa attention, packing off, or a draft, the limit stays the weights' break-even."""
    packing = KVBoost(kvboost_model("llama"), word_tokenizer(), chunking=8)
    plain = KVBoost(make_tiny_model("llama"), word_tokenizer(), chunking=8)
    drafting = KVBoost(kvboost_model("llama"), word_tokenizer(), chunking=8, draft_model=make_tiny_model("llama"))

    def break_even(engine):
        return forward_read_bytes(engine.model) // engine.factories.kv_bytes_per_token()

    assert PACKED_JOIN_PADDING_CELLS == 512 < break_even(packing)
    assert packing.core("prefix_cache").scheduler.join_padding_limit == PACKED_JOIN_PADDING_CELLS
    assert packing.core("prefix_cache", pack_forwards=False).scheduler.join_padding_limit == break_even(packing)
    assert plain.core("prefix_cache").scheduler.join_padding_limit == break_even(plain)
    assert drafting.core("prefix_cache").scheduler.join_padding_limit == break_even(drafting)


def test_a_prompt_arriving_while_rows_decode_is_prefilled_in_their_decode_steps_forward(monkeypatch):
    """Without a token budget a new prompt is prefilled whole: it joins the running row's batch, and its prompt
    forward (begun first: stored chunks loaded) is a part of that step's forward with the row's decode step; both
    rows get transformers' greedy tokens."""
    engine = KVBoost(kvboost_model("llama"), word_tokenizer(), chunking=8)
    parts: list[list[tuple[int, ...]]] = []

    def counted(model, packed):
        parts.append([tuple(part.input_ids.shape) for part in packed])
        return packed_forward(model, packed)

    monkeypatch.setattr(runner_module, "packed_forward", counted)
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=0)
    prompts = [words(94, 6), words(95, 9)]
    requests = [DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=6, sampling=GREEDY) for p in prompts]
    rows = engine.factories.new_rows(requests)
    core.scheduler.add(RequestGroup([rows[0]]))
    core.step()
    core.step()
    core.scheduler.add(RequestGroup([rows[1]]))
    core.step()
    assert parts == [[(1, 1), (1, len(requests[1].prompt_ids))]]
    core.run()
    assert [row.tokens for row in rows] == [engine_reference(engine, p, 6).tokens for p in prompts]


@st.composite
def packed_layouts(draw):
    """1-3 parts, each ``(cached columns, new columns, real tokens per row)``: 1-3 left-padded rows whose real tokens
    are their last 1 to ``cached + new`` columns (so padding may reach into the new columns, as in a chunk of a
    left-padded prompt); 0-12 columns cached, 1-6 new."""
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        cached, new = draw(st.integers(0, 12)), draw(st.integers(1, 6))
        reals = draw(st.lists(st.integers(1, cached + new), min_size=1, max_size=3))
        parts.append((cached, new, reals))
    return parts


@pytest.mark.parametrize("name", sorted(PACKED_MODELS))
@given(layout=packed_layouts(), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_any_packed_layout_gives_each_part_its_own_forwards_logits_and_kv(name, layout, seed):
    """For random parts (rows with different real lengths, left-padded, the padding reaching into the new columns
    of some), one packed forward leaves each part's cache (built from the model's config: sliding-window layers
    return their window only) and last-position logits as its own forward does."""
    model = PACKED_MODELS[name]
    generator = torch.Generator().manual_seed(seed)
    parts, references, expected = [], [], []
    for cached, new, reals in layout:
        mask = torch.zeros(len(reals), cached + new, dtype=torch.long)
        for row, real in enumerate(reals):
            mask[row, cached + new - real :] = 1
        ids = torch.randint(3, 128, tuple(mask.shape), generator=generator)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = DynamicCache(config=model.config)
        if cached:
            with torch.inference_mode():
                model(input_ids=ids[:, :cached], attention_mask=mask[:, :cached], position_ids=positions[:, :cached],
                      cache=cache, use_cache=True)  # fmt: skip
        part = ForwardPart(cache, ids[:, cached:], positions[:, cached:], mask, logits=True)
        reference = copy.deepcopy(cache)
        parts.append(part)
        references.append(reference)
        expected.append(alone(model, reference, part))
    for got, want, part, reference in zip(packed_forward(model, parts), expected, parts, references, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert_same_kv(part.cache, reference)


def test_a_prefill_that_fails_to_begin_fails_its_batch_only(monkeypatch):
    """Beginning a prefill (its stored chunks loaded, here a store read that raises) happens while the batches'
    shared forward is put together: the joining prompt's batch fails with the error, and the running row, whose
    batch shares no forward that step, goes on to transformers' tokens."""
    engine = KVBoost(kvboost_model("llama"), word_tokenizer(), chunking=8)
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=6)
    core.scheduler.join_padding_limit = 20
    prompts = [words(90, 4), words(92, 60)]
    requests = [DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=6, sampling=GREEDY) for p in prompts]
    rows = engine.factories.new_rows(requests)
    begin = decode_module.DecodeLoop._begin_prefill

    def failing(loop, work, columns=0):
        if work.rows[0] is rows[1]:
            raise OSError("store unreachable")
        return begin(loop, work, columns)

    monkeypatch.setattr(decode_module.DecodeLoop, "_begin_prefill", failing)
    failures: list[BaseException] = []
    core.scheduler.add(RequestGroup([rows[0]], on_fail=failures.append))
    core.step()
    core.scheduler.add(RequestGroup([rows[1]], on_fail=failures.append))
    core.run()
    assert [str(error) for error in failures] == ["store unreachable"]
    assert rows[0].tokens == engine_reference(engine, prompts[0], 6).tokens


def test_a_whole_unpadded_prompt_part_uses_sdpas_own_causal_path(monkeypatch):
    """A part whose queries are all its keys and which has no padding (a whole new prompt) attends with torch SDPA's
    ``is_causal`` and no mask, as its own forward does (the masked half of the square is skipped, not computed and
    hidden); a left-padded part gets its explicit mask."""
    model = kvboost_model("llama")
    calls: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    ids, mask, positions = padded([5, 3], seed=3)
    whole = ForwardPart(DynamicCache(), torch.arange(3, 9)[None], torch.arange(6)[None], torch.ones(1, 6), True)
    padded_part = ForwardPart(DynamicCache(), ids, positions, mask, logits=True)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    packed_forward(model, [whole, padded_part])
    assert calls == [(True, True), (False, False)] * model.config.num_hidden_layers
