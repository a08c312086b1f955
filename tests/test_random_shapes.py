"""Random-weight models of the benchmarks (``kvboost_hf.bench.shapes``): the same weights where a test or a copy
draft needs them, built on the CPU here and moved wherever the GPU tests run them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvboost_hf.bench.shapes import (
    copy_model,
    engine_copy,
    random_config,
    random_engine,
    random_model,
    save_random_model,
)
from kvboost_hf.offload import LayerStreamingConfig, enable_layer_streaming


def _same_weights(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    a, b = first.state_dict(), second.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[name].cpu(), b[name].cpu()) for name in a)


def _storages(model: torch.nn.Module) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}


def test_the_same_arguments_draw_the_same_weights():
    assert _same_weights(random_model("tiny", device="cpu"), random_model("tiny", device="cpu"))
    first, second = random_engine("tiny", device="cpu", chunking=16), random_engine("tiny", device="cpu", chunking=16)
    assert _same_weights(first.model, second.model)


def test_a_copy_holds_the_same_weights_in_its_own_storage_and_generates_the_same():
    engine = random_engine("tiny", device="cpu", chunking=16)
    twin = engine_copy(engine, device="cpu", chunking=16)
    assert _same_weights(engine.model, twin.model)
    assert not _storages(engine.model) & _storages(twin.model)
    prompt = "The quick brown fox jumps over the lazy dog."
    assert (
        twin.generate(prompt, 8, mode="baseline").output_ids == engine.generate(prompt, 8, mode="baseline").output_ids
    )
    with torch.no_grad():
        next(twin.model.parameters()).add_(1.0)  # its own storage: the original is untouched
    assert not _same_weights(engine.model, twin.model)


def test_a_copy_casts_where_asked_and_refuses_a_streamed_model():
    model = random_model("tiny", device="cpu")
    half = copy_model(model, dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert _same_weights(model.to(torch.bfloat16), half)
    streamed = random_model("tiny", device="cpu")
    enable_layer_streaming(streamed, LayerStreamingConfig(keep_first_k=1, keep_last_k=0, device="cpu"))
    with pytest.raises(ValueError, match="before enable_layer_streaming"):
        copy_model(streamed)


def test_shapes_config_overrides_and_tied_embeddings():
    small = random_config("qwen2.5-0.5b")
    assert (small.hidden_size, small.num_hidden_layers, small.num_key_value_heads) == (896, 24, 2)
    assert small.tie_word_embeddings is True and random_config("qwen2.5-7b").tie_word_embeddings is False
    assert random_config("tiny", vocab_size=1000).vocab_size == 1000


def test_a_saved_random_model_loads_with_its_tokenizer_and_vocabulary(tmp_path):
    folder = save_random_model("tiny", tmp_path / "tiny", device="cpu")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert loaded.config.vocab_size == len(tokenizer)
    assert _same_weights(loaded, random_model("tiny", device="cpu", vocab_size=len(tokenizer)))
