"""Differential tests: every ``generate()`` path of transformers, plain vs. with a :class:`ChunkReuseCache`.

Each case runs one transformers generation path three times on a tiny random model: plain (no cache argument,
or a ``DynamicCache`` where the case continues a cache), then twice with a fresh ``ChunkReuseCache`` on one shared
:class:`ChunkStore` (cold: stores; warm: must hit where the path allows reuse). Sequences must be identical and
scores, logits, hidden states and attentions equal within ``ATOL``, and the cache must end up as long as plain
transformers' (assisted decoding crops it). transformers' own ``GenerationTesterMixin`` is not shipped in its sdist
or wheel, so this suite drives the same paths through the public ``generate()`` API instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import TINY_ARCHITECTURES, make_tiny_model
from transformers import DynamicCache, PreTrainedModel

from kvboost_hf import ChunkReuseCache, ChunkStore, RepairConfig
from kvboost_hf.hf.cache import join_layers
from kvboost_hf.store.config import StoreConfig

CHUNK = 4
SLIDING_WINDOW = {"mistral", "gemma2"}  # no non-prefix reuse for these (the repair mask has no window)
NEW_TOKENS = 6
PROMPT_LEN = 26  # longer than the sliding window (24) of the Mistral and Gemma2 testers
ATOL = 1e-4


def make_cache(store: ChunkStore, model: PreTrainedModel, segment_starts: tuple[int, ...] = ()) -> ChunkReuseCache:
    """The cache under test; the one place that knows its constructor. Chunks of ``CHUNK`` tokens; segments (if
    any) are stored by content too, and a segment hit at another position is repaired by recomputing all of it,
    so even non-prefix reuse must reproduce plain generation."""
    return ChunkReuseCache(store, model, CHUNK, RepairConfig(ratio=1.0), segment_starts=segment_starts)


def tokens(length: int, seed: int) -> torch.Tensor:
    """``[1, length]`` random token ids in ``[1, 128)`` (0 is the pad token)."""
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def repetitive(length: int) -> torch.Tensor:
    """``[1, length]`` ids cycling through 5..10, so prompt lookup finds n-gram matches."""
    return (torch.arange(length) % 6 + 5)[None]


def left_padded(lengths: tuple[int, ...] = (PROMPT_LEN, 19, 13), seed: int = 3) -> dict[str, torch.Tensor]:
    """A left-padded batch of random rows of the given lengths: ``input_ids`` and ``attention_mask``."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = tokens(length, seed + row)[0]
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask}


# A case calls generate (once, or more for continuation) with the cache from ``new_cache`` (None for plain
# transformers) and returns every call's output.
CaseFn = Callable[[PreTrainedModel, PreTrainedModel, Callable[[], Any]], list[Any]]


@dataclass(frozen=True)
class Case:
    run: CaseFn
    reuses: bool | None = True  # the warm pass must read chunks from the store (None: a fix decides)
    cold_reuses: bool = False  # ... and so must the cold one (a later call hits what an earlier one stored)
    every_row_reuses: bool = False  # ... in every batch row of the prompt forward of its last call


def generate(model: PreTrainedModel, cache: Any, seed: int | None = None, **kwargs: Any) -> Any:
    """``model.generate`` with dict outputs, scores and logits; ``seed`` reseeds torch right before the call."""
    if seed is not None:
        torch.manual_seed(seed)
    options = dict(
        max_new_tokens=NEW_TOKENS,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    options.update(kwargs)
    if cache is not None:
        options["cache"] = cache
    return model.generate(**options)


def single(with_assistant: bool = False, **kwargs: Any) -> CaseFn:
    """A case of one generate call on ``input_ids`` (default: a random prompt) with ``kwargs``; with
    ``with_assistant``, assisted decoding by the architecture's assistant model."""
    kwargs.setdefault("input_ids", tokens(PROMPT_LEN, 0))

    def run(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
        extra = {"assistant_model": assistant} if with_assistant else {}
        return [generate(model, new_cache(), **kwargs, **extra)]

    return run


def assisted(**kwargs: Any) -> CaseFn:
    return single(with_assistant=True, **kwargs)


def hole_mask(length: int) -> torch.Tensor:
    """A 2D mask of ones with a 0 at position 1: not plain left padding."""
    mask = torch.ones(1, length, dtype=torch.long)
    mask[0, 1] = 0
    return mask


def embeds_case(**kwargs: Any) -> CaseFn:
    """Generate from the ``inputs_embeds`` of a random prompt alone (no token ids: nothing to look up)."""

    def run(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
        ids = tokens(PROMPT_LEN, 0)
        embeds = model.get_input_embeddings()(ids).detach()
        return [generate(model, new_cache(), inputs_embeds=embeds, **kwargs)]

    return run


def continuation(same_cache: bool = True, first_assisted: bool = False, padded: bool = False) -> CaseFn:
    """Generate, append a message to every row, generate again: on the same cache object (``same_cache``) or on
    a new one (the next turn then hits the chunks the first call wrote back). ``first_assisted``: the first call
    uses assisted decoding (it crops the cache); ``padded``: a left-padded batch of 3 rows."""

    def run(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
        prompt = left_padded() if padded else {"input_ids": tokens(PROMPT_LEN, 0), "attention_mask": None}
        ids, mask = prompt["input_ids"], prompt["attention_mask"]
        cache = new_cache()
        if same_cache and cache is None:
            cache = DynamicCache(config=model.config)
        extra = {"assistant_model": assistant} if first_assisted else {}
        first = generate(model, cache, input_ids=ids, attention_mask=mask, do_sample=False, **extra)
        follow = torch.cat([first.sequences, tokens(7, 1).expand(len(ids), -1)], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(len(ids), follow.shape[1] - mask.shape[1], dtype=torch.long)], 1)
        second_cache = cache if same_cache else new_cache()
        return [first, generate(model, second_cache, input_ids=follow, attention_mask=mask, do_sample=False)]

    return run


def eos_case(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
    """A 2-row batch whose eos is a token the first row emits early, with ``min_new_tokens`` holding it back."""
    ids = torch.cat([tokens(PROMPT_LEN, 0), tokens(PROMPT_LEN, 1)])
    free = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eos = int(free[0, PROMPT_LEN + 1])
    stopped = generate(model, new_cache(), input_ids=ids, eos_token_id=eos)
    held = generate(model, new_cache(), input_ids=ids, eos_token_id=eos, min_new_tokens=4)
    assert stopped.sequences[0, -1] == 0, "row 0 stops at eos and is padded"
    assert not (held.sequences[:, PROMPT_LEN : PROMPT_LEN + 4] == eos).any(), "min_new_tokens holds eos back"
    return [stopped, held]


def padded_after_rows_alone(
    model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]
) -> list[Any]:
    """Generate for each row alone (storing its chunks), then for the left-padded batch of those rows."""
    batch = left_padded()
    rows = [ids[mask.bool()][None] for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    alone = [generate(model, new_cache(), input_ids=row, do_sample=False) for row in rows]
    return [*alone, generate(model, new_cache(), **batch, do_sample=False)]


def new_tokens_only(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
    """Continue a cache passing only the new tokens and the full attention mask (a form generate() accepts)."""
    cache = new_cache() or DynamicCache(config=model.config)
    first = generate(model, cache, input_ids=tokens(PROMPT_LEN, 0))
    new = tokens(7, 1)
    mask = torch.ones(1, first.sequences.shape[1] + new.shape[1], dtype=torch.long)
    return [first, generate(model, cache, input_ids=new, attention_mask=mask)]


def embeds_and_ids(**kwargs: Any) -> CaseFn:
    """Generate from ``inputs_embeds`` together with their ``input_ids`` (repetitive prompt; prompt lookup works)."""

    def run(model: PreTrainedModel, assistant: PreTrainedModel, new_cache: Callable[[], Any]) -> list[Any]:
        ids = repetitive(PROMPT_LEN)
        embeds = model.get_input_embeddings()(ids).detach()
        return [generate(model, new_cache(), input_ids=ids, inputs_embeds=embeds, **kwargs)]

    return run


CASES: dict[str, Case] = {
    "greedy": Case(single(do_sample=False)),
    "sample": Case(single(do_sample=True, seed=7, top_k=20, top_p=0.9, temperature=0.7)),
    "beam_search": Case(single(num_beams=3, num_return_sequences=2, do_sample=False)),
    "beam_sample": Case(single(num_beams=3, num_return_sequences=2, do_sample=True, seed=7)),
    "assisted": Case(assisted(do_sample=False)),
    "assisted_sample": Case(assisted(do_sample=True, seed=7)),
    "prompt_lookup": Case(single(input_ids=repetitive(PROMPT_LEN), prompt_lookup_num_tokens=4, do_sample=False)),
    "left_padded_batch": Case(
        single(**left_padded(), do_sample=False),
        every_row_reuses=True,
    ),
    "left_padded_after_rows_alone": Case(padded_after_rows_alone, cold_reuses=True, every_row_reuses=True),
    "beam_search_left_padded": Case(single(**left_padded(), num_beams=3, do_sample=False)),
    "sample_num_return_sequences": Case(single(do_sample=True, seed=7, num_return_sequences=3)),
    "prompt_shorter_than_chunk": Case(single(input_ids=tokens(3, 0), do_sample=False), reuses=False),
    "prompt_of_whole_chunks": Case(single(input_ids=tokens(7 * CHUNK, 0), do_sample=False)),
    "assisted_early_exit": Case(single(assistant_early_exit=1, do_sample=False)),
    "prefill_chunk_size": Case(single(prefill_chunk_size=8, do_sample=False), reuses=None),
    "continue_with_new_tokens_only": Case(new_tokens_only),
    "output_hidden_states_attentions": Case(
        single(output_hidden_states=True, output_attentions=True, do_sample=False),
        reuses=None,  # prompt states exist only for computed tokens
    ),
    "mask_hole_greedy": Case(single(attention_mask=hole_mask(PROMPT_LEN), do_sample=False), reuses=False),
    "mask_hole_beam_search": Case(
        single(attention_mask=hole_mask(PROMPT_LEN), num_beams=3, do_sample=False), reuses=False
    ),
    "mask_hole_prompt_lookup": Case(
        single(
            input_ids=repetitive(PROMPT_LEN),
            attention_mask=hole_mask(PROMPT_LEN),
            prompt_lookup_num_tokens=4,
            do_sample=False,
        ),
        reuses=False,
    ),
    "mask_hole_assisted": Case(assisted(attention_mask=hole_mask(PROMPT_LEN), do_sample=False), reuses=False),
    "inputs_embeds": Case(embeds_case(do_sample=False), reuses=False),
    "inputs_embeds_prompt_lookup": Case(embeds_and_ids(prompt_lookup_num_tokens=4, do_sample=False), reuses=False),
    "continuation": Case(continuation()),
    "continuation_after_assisted": Case(continuation(first_assisted=True)),
    "continuation_left_padded": Case(continuation(padded=True)),
    "next_turn_new_cache": Case(continuation(same_cache=False), cold_reuses=True),
    "eos_min_new_tokens": Case(eos_case, cold_reuses=True),  # its second call hits what the first stored
    "input_id_processors": Case(  # processors that read the whole input_ids every step
        single(
            input_ids=repetitive(PROMPT_LEN),
            repetition_penalty=1.5,
            no_repeat_ngram_size=3,
            bad_words_ids=[[7, 8], [11]],
            sequence_bias={(9, 10): -5.0},
            suppress_tokens=[5],
            do_sample=False,
        )
    ),
}


def assert_same_output(got: Any, expected: Any, where: str) -> None:
    """Identical sequences (and beam scores/indices) and cache length; every score, logit, hidden state and
    attention within ``ATOL``."""
    assert torch.equal(got.sequences, expected.sequences), f"{where}: sequences differ"
    for name in ("scores", "logits", "hidden_states", "attentions"):
        got_steps, expected_steps = getattr(got, name) or (), getattr(expected, name) or ()
        assert len(got_steps) == len(expected_steps), f"{where}: {name} count differs"
        for step, (a, b) in enumerate(zip(got_steps, expected_steps, strict=True)):
            prefix = f"{where}: {name}[{step}]"
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, prefix=prefix: f"{prefix}: {m}")
    cached, expected_cached = got.past_key_values.get_seq_length(), expected.past_key_values.get_seq_length()
    assert cached == expected_cached, f"{where}: the cache holds {cached} positions, plain {expected_cached}"
    for name in ("sequences_scores", "beam_indices"):
        if getattr(expected, name, None) is not None:
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=ATOL, rtol=0)


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """These models are so small that intra-op threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny model without an eos token, so it generates exactly ``NEW_TOKENS`` unless a case sets one."""
    model = make_tiny_model(arch, seed=seed).to(dtype)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[PreTrainedModel, PreTrainedModel]]:
    """Per architecture: the model and an assistant of the same vocabulary (another seed)."""
    return {name: (tiny(name), tiny(name, seed=1)) for name in TINY_ARCHITECTURES}


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_generate_path_matches_plain(models, arch: str, case_name: str) -> None:
    case = CASES[case_name]
    model, assistant = models[arch]
    expected = case.run(model, assistant, lambda: None)
    store = ChunkStore(StoreConfig(1 << 26))
    caches: list[ChunkReuseCache] = []  # the caches of the current pass, in creation order

    def new_cache() -> ChunkReuseCache:
        caches.append(make_cache(store, model))
        return caches[-1]

    for attempt in ("cold", "warm"):
        hits_before = store.stats()["hits"]
        caches.clear()
        got = case.run(model, assistant, new_cache)
        assert len(got) == len(expected)
        for call, (out, ref) in enumerate(zip(got, expected, strict=True)):
            assert_same_output(out, ref, f"{attempt} call {call}")
        hits = store.stats()["hits"] - hits_before
        expect_hits = case.reuses if attempt == "warm" else case.cold_reuses
        assert expect_hits is None or (hits > 0) == expect_hits, f"{attempt}: {hits} hits"
        if attempt == "warm" and case.every_row_reuses:
            assert all(row.hit_chunks > 0 for row in caches[-1].last_reuse), caches[-1].last_reuse


def additive_causal_mask(queries: int, keys: int) -> torch.Tensor:
    """A custom 4D float mask ``[1, 1, queries, keys]``: query ``i`` sees keys ``0..keys - queries + i``."""
    past = keys - queries
    allowed = torch.arange(keys)[None, :] <= torch.arange(queries)[:, None] + past
    return torch.zeros(1, 1, queries, keys).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_custom_4d_mask_forward_then_crop_matches_dynamic_cache(models, arch: str) -> None:
    """``generate()`` refuses 4D masks, so drive the forward + crop + forward sequence of assisted decoding by hand."""
    model = models[arch][0]
    ids = tokens(16, 0)
    results = []
    for cache in (DynamicCache(config=model.config), make_cache(ChunkStore(StoreConfig(1 << 26)), model)):
        with torch.no_grad():
            model(ids, attention_mask=additive_causal_mask(16, 16), cache=cache, use_cache=True)
            cache.crop(-4)  # reject the last 4 "draft" tokens
            logits = model(
                ids[:, 12:14],
                attention_mask=additive_causal_mask(2, 14),
                cache=cache,
                use_cache=True,
                position_ids=torch.arange(12, 14)[None],
            ).logits
        results.append((logits, cache.get_seq_length()))
    (expected, expected_length), (got, length) = results
    assert length == expected_length == 14
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


SEGMENT = 8
REPAIR_PATHS = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "seed": 7},
    "beam_search": {"num_beams": 3, "num_return_sequences": 2, "do_sample": False},
    "assisted": {"do_sample": False, "assisted": True},
    "prompt_lookup": {"do_sample": False, "prompt_lookup_num_tokens": 4},
}


@pytest.mark.parametrize("path", list(REPAIR_PATHS))
@pytest.mark.parametrize("arch", sorted(set(TINY_ARCHITECTURES) - SLIDING_WINDOW))
def test_moved_segments_fully_repaired_match_plain(models, arch: str, path: str) -> None:
    """A prompt whose two documents swap places hits them by content key at new positions; with every moved
    token recomputed, the non-prefix (stitch, re-rotate, repair forward) path must equal plain generation."""
    model, assistant = models[arch]
    system, doc_x, doc_y, question = (tokens(SEGMENT, seed) for seed in (10, 11, 12, 13))
    segments = tuple(range(0, 4 * SEGMENT, SEGMENT))
    kwargs = dict(REPAIR_PATHS[path])
    if kwargs.pop("assisted", False):
        kwargs["assistant_model"] = assistant
    store = ChunkStore(StoreConfig(1 << 26))
    generate(model, make_cache(store, model, segments), input_ids=torch.cat([system, doc_x, doc_y, question], 1))
    swapped = torch.cat([system, doc_y, doc_x, question], 1)
    expected = generate(model, None, input_ids=swapped, **kwargs)
    cache = make_cache(store, model, segments)
    assert_same_output(generate(model, cache, input_ids=swapped, **kwargs), expected, path)
    repaired = cache.last_reuse[0].recomputed_tokens
    if path == "beam_search":  # its prompt forward has one row per beam: prefix hits only
        assert repaired == 0
    else:
        assert repaired >= 2 * SEGMENT, cache.last_reuse


@pytest.mark.parametrize("path", ["greedy", "beam_search"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_bf16_matches_plain_bit_for_bit(arch: str, path: str) -> None:
    """In bf16, stitched K/V are the very values plain transformers computes, so even rounding must agree (``ATOL``
    is far below one bf16 step of these logits); sliding-window layers must show attention the same key columns as
    transformers' sliding layers for that."""
    model = tiny(arch, dtype=torch.bfloat16)
    kwargs = {"do_sample": False, "input_ids": tokens(PROMPT_LEN, 0)}
    if path == "beam_search":
        kwargs["num_beams"] = 3
    expected = generate(model, None, **kwargs)
    store = ChunkStore(StoreConfig(1 << 26))
    for attempt in ("cold", "warm"):
        assert_same_output(generate(model, make_cache(store, model), **kwargs), expected, attempt)
    assert store.stats()["hits"] > 0


@pytest.mark.parametrize("arch", sorted(SLIDING_WINDOW))
def test_sliding_layers_show_the_window_and_keep_every_column(models, arch: str) -> None:
    """Layers follow ``layer_types`` like ``DynamicCache(config=...)``: each sliding layer hands attention the same
    key columns and mask sizes as transformers' sliding layer, yet keeps every column for write-back."""
    model = models[arch][0]
    ids = tokens(PROMPT_LEN + 3, 0)
    reference, cache = DynamicCache(config=model.config), make_cache(ChunkStore(StoreConfig(1 << 26)), model)
    assert cache.is_sliding == reference.is_sliding and any(cache.is_sliding)
    for step in (ids[:, :PROMPT_LEN], ids[:, PROMPT_LEN : PROMPT_LEN + 1], ids[:, PROMPT_LEN + 1 :]):
        for layer_idx in range(len(cache.layers)):
            sizes = cache.get_mask_sizes(step.shape[1], layer_idx)
            assert sizes == reference.get_mask_sizes(step.shape[1], layer_idx)
        with torch.no_grad():
            model(step, cache=reference, use_cache=True)
            model(step, cache=cache, use_cache=True)
    for layer, ref_layer in zip(cache.layers, reference.layers, strict=True):
        assert layer.keys.shape[-2] == ids.shape[1]  # every column kept
        torch.testing.assert_close(layer.keys[:, :, -ref_layer.keys.shape[-2] :], ref_layer.keys, atol=0, rtol=0)


def test_join_refuses_layers_that_keep_only_the_window(models) -> None:
    model = models["mistral"][0]
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    with torch.no_grad():
        for cache in caches:
            model(tokens(PROMPT_LEN, 0), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer: it keeps only its window"):
        join_layers(*caches)


def test_unsupported_layer_types_are_refused() -> None:
    model = tiny("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"llama has layers of type \['linear_attention'\]"):
        make_cache(ChunkStore(StoreConfig(1 << 20)), model)
