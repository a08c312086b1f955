"""Model digest: every weight byte counts, adapters count, an explicit model_id replaces the weight hash."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoTokenizer

from kvboost_hf import InferenceEngine
from kvboost_hf.bench.shapes import tokenizer_dir
from kvboost_hf.core import keys
from kvboost_hf.core.keys import digests_held, forget_model_digest, model_digest


def test_swapping_two_embedding_rows_changes_the_digest():
    """The sampled digest this replaces missed exactly this edit (SmolLM2 rows 198 and 29)."""
    model = make_tiny_model("llama")
    before = model_digest(model)
    assert model_digest(make_tiny_model("llama")) == before  # same weights, another object: same digest
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[[29, 98]] = embed[[98, 29]].clone()
    forget_model_digest(model)
    assert model_digest(model) != before


def test_one_changed_bit_changes_the_digest():
    model = make_tiny_model("qwen2")
    before = model_digest(model)
    with torch.no_grad():
        weight = model.model.layers[-1].mlp.down_proj.weight
        flat = weight.view(-1).view(torch.int32)
        flat[flat.numel() // 2] ^= 1
    forget_model_digest(model)
    assert model_digest(model) != before


def test_digest_is_cached_until_the_tensors_change():
    model = make_tiny_model("llama")
    first = model_digest(model)
    assert model_digest(model) == first
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    second = model_digest(model)  # an in-place edit moves the version counter: recomputed
    assert second != first
    model.register_buffer("extra", torch.zeros(3))  # a new tensor (as an adapter load adds): recomputed
    third = model_digest(model)
    assert third not in (first, second)
    up, gate = model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.gate_proj
    up.weight, gate.weight = gate.weight, up.weight  # the same tensors, moved between modules: recomputed
    assert model_digest(model) not in (first, second, third)


def test_active_adapters_change_the_digest():
    model = make_tiny_model("llama")
    plain = model_digest(model, model_id="m@1")
    model.peft_config = {"a": {"r": 8}, "b": {"r": 16}}
    model.active_adapters = lambda: ["a"]
    with_a = model_digest(model, model_id="m@1")
    model.active_adapters = lambda: ["b"]
    assert len({plain, with_a, model_digest(model, model_id="m@1")}) == 3


def test_model_id_replaces_the_weight_hash():
    a, b = make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1)
    assert model_digest(a) != model_digest(b)
    assert model_digest(a, model_id="ckpt@rev1") == model_digest(b, model_id="ckpt@rev1")
    assert model_digest(a, model_id="ckpt@rev1") != model_digest(a, model_id="ckpt@rev2")
    assert model_digest(a, model_id="ckpt@rev1") != model_digest(a)


def test_offloaded_weights_need_a_model_id():
    with torch.device("meta"):
        model = make_tiny_model("llama")
    with pytest.raises(ValueError, match="model_id"):
        model_digest(model)
    assert model_digest(model, model_id="x")


def test_inference_tensors_have_a_digest():
    """A buffer created under inference_mode (as quantized layers pack theirs on a first forward) has no version
    counter; the digest is still computed, cached, and changes when the buffer is replaced."""
    model = make_tiny_model("llama", seed=2)
    with torch.inference_mode():
        model.register_buffer("packed", torch.arange(6.0))
    first = model_digest(model)
    assert model_digest(model) == first
    with torch.inference_mode():
        model.packed = torch.arange(6.0) + 1
    assert model_digest(model) != first


def test_a_length_dependent_rope_forward_leaves_the_digest_alone():
    """Dynamic NTK rewrites its rotary inv_freq (a non-persistent buffer) after a long forward: the digest, hence
    the store namespace, must not follow it (caches built after a long request missed everything)."""
    model = make_tiny_model(
        "llama", max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 4.0}
    )
    before = model_digest(model)
    model(torch.randint(1, 128, (1, 90)))
    assert not torch.equal(model.model.rotary_emb.inv_freq, model.model.rotary_emb.original_inv_freq)
    assert model_digest(model) == before


def test_held_digests_check_each_model_once_and_only_inside_the_block(monkeypatch):
    model = make_tiny_model("llama")
    checks = []
    original = keys._signature
    monkeypatch.setattr(keys, "_signature", lambda m: checks.append(m) or original(m))
    first = model_digest(model)
    with digests_held():
        assert model_digest(model) == first
        with digests_held():  # nested: the outer block's digests
            assert model_digest(model) == first
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(1.0)  # inside the block: not seen (the engine holds its lock)
        assert model_digest(model) == first
        assert model_digest(model, model_id="m@1") != first  # another model_id: its own digest
    assert len(checks) == 2  # the first call, then one for the block; the model_id digest reads no weight
    assert model_digest(model) != first  # after the block: checked again, the edit seen


def test_an_engine_request_checks_the_weights_once(monkeypatch):
    """The request's batch policy and its cache both name their chunks by the model's digest: one check serves
    both (each walks every module and tensor)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    engine = InferenceEngine(make_tiny_model("qwen2", vocab_size=len(tokenizer)), tokenizer, chunking=16)
    engine.generate("a first request", max_new_tokens=2)
    checks = []
    original = keys._signature
    monkeypatch.setattr(keys, "_signature", lambda m: checks.append(m) or original(m))
    engine.generate("a first request and a second", max_new_tokens=2)
    assert checks == [engine.model]
