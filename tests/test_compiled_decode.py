"""A static ``ChunkReuseCache`` (``max_cache_len``): compiled decode steps trace once, and outputs stay exact.

The oracle is transformers' own ``generate()`` (``tests/oracle.py``, or ``model.generate`` on a plain cache): the
static mode must give the same fp32 greedy tokens eagerly, under ``torch.compile(fullgraph=True, dynamic=False)``
and through ``generate()``'s own compiled decode path, and every cache operation must leave the same K/V as the
default (growing) mode.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import TINY_ARCHITECTURES, greedy, make_tiny_model
from helpers import documents, shuffled_prompt, warm_alone
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import reference
from torch._dynamo.utils import counters
from transformers import CompileConfig

from kvboost_hf import ChunkReuseCache, ChunkStore, RepairConfig
from kvboost_hf.hf.cache import prompt_padding_mask
from kvboost_hf.hf.layers import CacheCapacityError, ChunkReuseLayer, ChunkReuseSlidingLayer
from kvboost_hf.hf.models import CACHE_ARGUMENT
from kvboost_hf.hf.prefill import forward
from kvboost_hf.store.config import StoreConfig

CHUNK = 16
CAPACITY = 96  # tokens: every prompt and generation of this file fits
STEPS = 12  # compiled decode steps per test


def static_cache(model, store=None, **options) -> ChunkReuseCache:
    store = store if store is not None else ChunkStore(StoreConfig(1 << 26))
    return ChunkReuseCache(store, model, chunking=CHUNK, max_cache_len=CAPACITY, **options)


def decode(model, cache, prompt: torch.Tensor, steps: int, step_forward) -> list[int]:
    """Greedy tokens of ``prompt`` (one row): an eager prompt forward through ``cache``, then ``steps`` decode
    steps of ``step_forward`` (``model.forward`` or a compiled one) with static shapes: one token, its position,
    a padding mask as wide as the cache's capacity (transformers' causal mask hides the unwritten columns)."""
    out = forward(model, cache, input_ids=prompt, attention_mask=torch.ones_like(prompt), logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [int(token)]
    mask = torch.ones(1, CAPACITY, dtype=torch.long, device=prompt.device)
    for step in range(steps):
        with torch.inference_mode():
            out = step_forward(
                input_ids=token,
                position_ids=torch.tensor([[prompt.shape[1] + step]], device=prompt.device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
            )
        token = out.logits[:, -1].argmax(-1, keepdim=True).clone()  # a CUDA graph's output is overwritten next step
        cache.record(token)
        tokens.append(int(token))
    cache.save()  # write-back, as generate()'s adapter does at the end
    return tokens


def prompt(length: int = 30, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("arch", "backend"), [("llama", "eager"), ("qwen2", "eager"), ("llama", "aot_eager")])
def test_compiled_decode_step_is_one_graph_and_gives_generates_tokens(arch, backend):
    model = make_tiny_model(arch)
    ids = prompt()
    expected = reference(model, ids[0].tolist(), STEPS + 1).tokens
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second graph for a new length would raise
        got = decode(model, static_cache(model, adapter=False), ids, STEPS, compiled)
    assert got == expected
    assert counters["stats"]["unique_graphs"] == 1  # all 12 steps (12 lengths) ran the first graph
    assert not counters["graph_break"]  # fullgraph=True would have raised anyway


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_static_mode_eager_equals_plain_generate_and_reuses(arch):
    """Sliding-window layers included (mistral, gemma2): the capacity-wide mask applies their window."""
    model = make_tiny_model(arch)
    ids = prompt(40)
    expected = reference(model, ids[0].tolist(), STEPS + 1).tokens
    store = ChunkStore(StoreConfig(1 << 26))
    for attempt in range(2):  # the first stores the chunks, the second stitches them
        cache = static_cache(model, store, adapter=False)
        assert decode(model, cache, ids, STEPS, model.forward) == expected, f"attempt {attempt}"
    assert cache.last_reuse[0].cached_tokens == 32  # two full chunks stitched


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generate_takes_its_compiled_decode_path_and_stays_exact(arch):
    """The drop-in spelling: ``generate()`` sees ``is_compileable`` and compiles its decode forward (here on the
    CPU, which a ``CompileConfig`` allows); the adapter's hooks run eagerly around it. A left-padded batch of two,
    twice (the second call stitches stored chunks under generate's prepared 4D masks)."""
    model = make_tiny_model(arch)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    ids[1, :3] = 0
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    expected = greedy(model, ids, attention_mask=mask, new=10)[0]
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    store = ChunkStore(StoreConfig(1 << 26))
    torch._dynamo.reset()
    counters.clear()
    for attempt in range(2):
        cache = static_cache(model, store)
        got = greedy(model, ids, cache, attention_mask=mask, new=10, compile_config=config)[0]
        assert torch.equal(got, expected), f"attempt {attempt}"
        assert cache.pads == [0, 3]
    assert [row.cached_tokens for row in cache.last_reuse] == [32, 29]  # 32 columns stitched for both rows
    shorter, shorter_mask = ids[:, 7:], mask[:, 7:]  # another prompt length, a fresh cache: the same graph
    expected = greedy(model, shorter, attention_mask=shorter_mask, new=10)[0]
    got = greedy(model, shorter, static_cache(model, store), attention_mask=shorter_mask, new=10, compile_config=config)
    assert torch.equal(got[0], expected)
    assert counters["stats"]["unique_graphs"] == 1  # generate() compiled its decode forward, once for every call


def test_static_mode_leaves_the_same_kv_as_the_default_mode_through_every_cache_operation():
    """Crop, row selection, a join, per-row column selection and decode steps between them: the static layers
    hold what the growing ones hold, and the next tokens agree."""
    model = make_tiny_model("qwen2")
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(7))
    other_ids = torch.randint(1, 128, (1, 26), generator=torch.Generator().manual_seed(8))
    store = ChunkStore(StoreConfig(1 << 26))
    caches = []
    for max_cache_len in (None, CAPACITY):
        cache, other = (
            ChunkReuseCache(store, model, chunking=CHUNK, adapter=False, max_cache_len=max_cache_len) for _ in range(2)
        )
        tokens = [run_step(model, cache, ids)]
        run_step(model, other, other_ids)
        for _ in range(3):
            tokens.append(run_step(model, cache, tokens[-1]))
        cache.crop(-2)
        tokens.append(run_step(model, cache, tokens[-1]))
        cache.batch_select_indices(torch.tensor([1, 0]))
        tokens.append(run_step(model, cache, tokens[-1][[1, 0]]))
        cache.join(other)
        tokens.append(run_step(model, cache, torch.cat([tokens[-1], torch.tensor([[5]])])))
        width = cache.num_columns
        cache.keep_row_columns([list(range(width - 1)), list(range(width)), list(range(3, width))])
        tokens.append(run_step(model, cache, tokens[-1]))
        caches.append((cache, tokens))
    (growing, growing_tokens), (static, static_tokens) = caches
    assert all(torch.equal(a, b) for a, b in zip(growing_tokens, static_tokens, strict=True))
    assert static.get_seq_length() == growing.get_seq_length() == static.num_columns
    assert torch.equal(static.tokens, growing.tokens) and static.pads == growing.pads
    for mine, theirs in zip(static.layers, growing.layers, strict=True):
        assert mine.capacity == CAPACITY and mine.keys.shape == theirs.keys.shape
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def run_step(model, cache: ChunkReuseCache, fed: torch.Tensor) -> torch.Tensor:
    """One forward of ``fed`` through ``cache`` (its padded columns masked): the greedy next token per row."""
    mask = torch.ones(fed.shape[0], cache.num_columns + fed.shape[1], dtype=torch.long)
    for row, pad in enumerate(cache.pads):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -fed.shape[1] :]
    out = forward(model, cache, input_ids=fed, attention_mask=mask, position_ids=positions, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def test_static_mode_repairs_non_prefix_hits_as_the_default_mode_does():
    """The sparse forward (documents stored alone, reused in another order, selectively repaired) scatters into
    the static buffers: same reuse figures and tokens as the default mode."""
    model = make_tiny_model("llama")
    store = ChunkStore(StoreConfig(1 << 26))
    docs = documents(2)
    for doc in docs:
        warm_alone(model, store, doc)
    ids, starts = shuffled_prompt(docs, [1, 0], torch.tensor([5, 6, 7]))
    results = []
    for max_cache_len in (None, CAPACITY):
        cache = ChunkReuseCache(
            store,
            model,
            CHUNK,
            RepairConfig(strategy="selective", ratio=0.3),
            segment_starts=starts,
            write_back=False,
            max_cache_len=max_cache_len,
        )
        results.append((greedy(model, ids, cache)[0], cache.last_reuse))
    (growing, growing_reuse), (static, static_reuse) = results
    assert static_reuse == growing_reuse and static_reuse[0].approx_tokens > 0
    assert torch.equal(static, growing)


def test_static_mode_refuses_more_tokens_than_its_capacity():
    model = make_tiny_model("llama")
    cache = static_cache(model, adapter=False)
    with pytest.raises(CacheCapacityError, match="max_cache_len is 96"):
        forward(model, cache, input_ids=prompt(CAPACITY + 1), logits_to_keep=1)
    cache = static_cache(model, adapter=False)
    forward(model, cache, input_ids=prompt(CAPACITY), logits_to_keep=1)
    with pytest.raises(CacheCapacityError, match="cannot take 1 more"):
        forward(model, cache, input_ids=torch.tensor([[3]]), logits_to_keep=1)


def test_only_the_static_mode_is_compileable_and_it_masks_its_capacity():
    model = make_tiny_model("mistral")  # sliding-window layers
    growing = ChunkReuseCache(ChunkStore(StoreConfig(1 << 26)), model, adapter=False)
    static = static_cache(model, adapter=False)
    assert not growing.is_compileable and static.is_compileable
    forward(model, static, input_ids=prompt(30), logits_to_keep=1)
    assert static.get_mask_sizes(1, 0) == (CAPACITY, 0) and static.get_max_length() == CAPACITY
    assert static.get_seq_length() == 30 and static.layers[0]._key_buffer.shape[-2] == CAPACITY


def test_a_cache_switches_between_growing_and_static_keeping_its_kv_and_its_greedy_tokens():
    """set_max_cache_len: growing -> static (one copy into fixed buffers) -> growing again, decoding between the
    switches; the K/V held and the greedy tokens are a growing cache's throughout (sliding-window layers too)."""
    model = make_tiny_model("mistral")
    ids = prompt(30)
    expected = reference(model, ids[0].tolist(), 6).tokens

    def step(cache, token):
        out = forward(model, cache, input_ids=token, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    cache = ChunkReuseCache(ChunkStore(StoreConfig(1 << 26)), model, mode="baseline", adapter=False)
    token = forward(model, cache, input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    held = [layer.keys.clone() for layer in cache.layers]
    cache.set_max_cache_len(CAPACITY)
    assert cache.is_compileable and cache.get_mask_sizes(1, 0) == (CAPACITY, 0)
    assert all(layer._key_buffer.shape[-2] == CAPACITY for layer in cache.layers)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, held, strict=True))
    for _ in range(3):
        tokens.append(token := step(cache, token))
    cache.set_max_cache_len(None)
    assert not cache.is_compileable and cache.get_seq_length() == 33
    for _ in range(2):
        tokens.append(token := step(cache, token))
    assert torch.cat(tokens, dim=1)[0].tolist() == expected
    with pytest.raises(CacheCapacityError, match="cannot hold the layer's 35 tokens"):
        cache.set_max_cache_len(34)


def test_prompt_padding_mask_reads_left_padding_from_prepared_masks():
    allowed = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    causal = torch.ones(4, 6, dtype=torch.bool).tril()
    bool_mask = causal[None, None].expand(2, 1, 4, 6).clone()
    bool_mask[:, 0, :, :4] &= allowed[:, None, :]  # padding columns hidden from every query
    assert torch.equal(prompt_padding_mask(bool_mask, 4), allowed.long())
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    assert torch.equal(prompt_padding_mask({"sliding_attention": additive}, 4), allowed.long())
    assert prompt_padding_mask({"full_attention": None}, 4) is None
    two_d = torch.ones(2, 4)
    assert prompt_padding_mask(two_d, 4) is two_d


NO_CUDA = not torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_graphed_decode_gives_generates_tokens_in_fp32(arch):
    """``torch.compile(mode="reduce-overhead")``: the decode step captured as a CUDA graph once, replayed at every
    length; fp32 greedy tokens equal transformers' eager ``generate()``."""
    model = make_tiny_model(arch).to("cuda")
    ids = prompt().to("cuda")
    expected = reference(model, ids[0].tolist(), STEPS + 1).tokens
    torch._dynamo.reset()
    counters.clear()
    graphed = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert decode(model, static_cache(model, adapter=False), ids, STEPS, graphed) == expected
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_generate_on_cuda_compiles_by_itself_with_a_static_cache_and_stays_exact():
    """On CUDA ``generate()`` compiles its decode forward for a compileable cache with its default
    ``CompileConfig`` (inductor, reduce-overhead: CUDA graphs), as it does for ``StaticCache``."""
    model = make_tiny_model("llama").to("cuda")
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(5)).to("cuda")
    expected = greedy(model, ids, new=10)[0]
    store = ChunkStore(StoreConfig(1 << 26))
    torch._dynamo.reset()
    counters.clear()
    for attempt in range(2):
        got = greedy(model, ids, static_cache(model, store), new=10)[0]
        assert torch.equal(got, expected), f"attempt {attempt}"
    assert counters["stats"]["unique_graphs"] >= 1


OPERATIONS = st.one_of(
    st.tuples(st.just("update"), st.integers(1, 5)),
    st.tuples(st.just("crop"), st.integers(0, 6)),
    st.tuples(st.just("select"), st.lists(st.integers(0, 7), min_size=1, max_size=3)),  # row numbers mod rows
    st.tuples(st.just("assign"), st.integers(0, 6)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPERATIONS, min_size=1, max_size=12), st.booleans())
def test_a_static_layer_holds_what_a_growing_layer_holds_after_any_operations(operations, sliding):
    """Appends, crops, row selection (fewer, more or repeated rows) and assigned leading columns, in any order:
    the written columns are equal, the static buffers keep their capacity and hold no non-finite value, and a
    static update returns the whole buffers whose leading columns are the growing layer's."""
    make = (lambda cap=None: ChunkReuseSlidingLayer(3, cap)) if sliding else ChunkReuseLayer
    growing, static = make(), make(40)
    generator = torch.Generator().manual_seed(len(operations))
    rows = 2
    for name, argument in operations:
        length = growing.get_seq_length()
        if name == "update" and length + argument <= 40:
            keys, values = (torch.randn(rows, 2, argument, 4, generator=generator) for _ in range(2))
            growing.update(keys, values)
            full_keys, full_values = static.update(keys, values)
            assert full_keys.shape[-2] == 40 and torch.equal(full_keys[:, :, : length + argument], growing.keys)
            assert torch.equal(full_values[:, :, : length + argument], growing.values)
        elif name == "crop":
            growing.crop(-min(argument, length))
            static.crop(-min(argument, length))
        elif name == "select" and growing.is_initialized and growing.keys.dim() == 4:
            indices = torch.tensor([row % rows for row in argument])
            growing.batch_select_indices(indices)
            static.batch_select_indices(indices)
            rows = len(indices)
        elif name == "assign" and growing.is_initialized and growing.keys.dim() == 4:
            kept = min(argument, length)
            for layer in (growing, static):
                layer.keys, layer.values = layer.keys[:, :, :kept], layer.values[:, :, :kept]
        assert static.get_seq_length() == growing.get_seq_length()
        if growing.is_initialized and growing.keys.dim() == 4:
            assert torch.equal(static.keys, growing.keys) and torch.equal(static.values, growing.values)
            assert static._key_buffer.shape[-2] == 40 and static._key_buffer.isfinite().all()
