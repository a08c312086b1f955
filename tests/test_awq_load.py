"""AWQ GEMM checkpoints loaded without gptqmodel (``tools/awq_load.py``): a checkpoint written by ``awq_pack``
computes what the same float model quantized in memory computes, with its other weights rounded to float16 as the
checkpoint stores them."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from conftest import make_tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from kvboost_hf.core.errors import InputError
from kvboost_hf.kernels.awq_linear import AwqInt4Linear, replace_awq_linears
from kvboost_hf.tools.awq_load import load_awq_model, rebuild_computed_buffers
from kvboost_hf.tools.awq_pack import int4_model, pack_checkpoint


def assert_computes_as_packed(loaded, model) -> None:
    """``loaded`` has the 14 int4 layers of a tiny model and computes what ``model`` quantized in memory does."""
    int4_model(model, group_size=32)  # the reference: the same quantization, in memory
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())  # the checkpoint keeps non-quantized weights in float16
    assert sum(isinstance(m, AwqInt4Linear) for m in loaded.modules()) == 14
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", True), ("llama", False)])
def test_a_packed_checkpoint_loads_as_int4_layers(tmp_path, monkeypatch, arch, tied):
    monkeypatch.delenv("TRITON_INTERPRET")  # the plain-torch path: these tests are about loading
    model = make_tiny_model(arch, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "src")
    pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=32)
    loaded = load_awq_model(tmp_path / "dst", dtype=torch.float32)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert_computes_as_packed(loaded, model)


def tiny_gemma() -> transformers.PreTrainedModel:
    """A Gemma of ``make_tiny_model``'s size (the conftest list has Gemma2 only)."""
    torch.manual_seed(0)
    config = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=128)  # fmt: skip
    return transformers.GemmaForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_computed_buffers_are_filled_in_place(tmp_path, monkeypatch, arch):
    """Gemma's scaled embedding holds a computed ``embed_scale`` buffer: the loader rebuilt every module with one as
    ``type(module)(config)`` (TypeError for the embedding, whose loaded weight and ``lm_head`` tie it would drop)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    model = tiny_gemma() if arch == "gemma" else make_tiny_model("gemma2")
    model.save_pretrained(tmp_path / "src")
    pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=32)
    loaded = load_awq_model(tmp_path / "dst", dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert float(loaded.model.embed_tokens.embed_scale) == 64**0.5
    assert_computes_as_packed(loaded, model)


def test_a_buffer_no_initializer_computes_is_named():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_tiny_model("llama").config)
    model.model.register_buffer("mystery", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(InputError, match=r"model \(LlamaModel\).*mystery"):
        rebuild_computed_buffers(model, torch.device("cpu"))


def rename_to_one_shard(folder) -> None:
    """Turn ``model.safetensors`` into an index naming one shard, as some hub repositories ship a small model."""
    shard = "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(folder / shard)
    weight_map = dict.fromkeys(load_file(folder / shard), shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["sharded", "one_indexed_shard"])
def test_a_sharded_checkpoint_packs_into_its_own_shard_names(tmp_path, monkeypatch, layout):
    """The packed shards keep the source's names, with an index: the float source shards were copied over them
    (the loader then returned a float model under an int4 config) and one indexed shard got no index."""
    monkeypatch.delenv("TRITON_INTERPRET")
    model = make_tiny_model("llama")
    if layout == "sharded":
        model.save_pretrained(tmp_path / "src", max_shard_size="100KB")
    else:
        model.save_pretrained(tmp_path / "src")
        rename_to_one_shard(tmp_path / "src")
    pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=32)
    weight_map = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {key for shard in set(weight_map.values()) for key in load_file(tmp_path / "dst" / shard)}
    assert stored == set(weight_map) and sum(key.endswith(".qweight") for key in stored) == 14
    assert_computes_as_packed(load_awq_model(tmp_path / "dst", dtype=torch.float32), model)


def test_an_awq_config_over_float_weights_is_refused(tmp_path):
    """A checkpoint whose config says AWQ but whose tensors are float loaded silently as a float model."""
    make_tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                     "version": "gemm"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="no linear layer of the model has a qweight"):
        load_awq_model(tmp_path, dtype=torch.float32)


def test_the_generation_config_is_the_checkpoints(tmp_path):
    """Extra stop tokens and sampling defaults come from ``generation_config.json``, as ``from_pretrained`` reads them
    (the loader kept the defaults derived from ``config.json``: one EOS id, no sampling settings)."""
    model = make_tiny_model("llama", eos_token_id=1, bos_token_id=2)
    model.generation_config = GenerationConfig(eos_token_id=[1, 7], bos_token_id=2, do_sample=True, temperature=0.6)
    model.save_pretrained(tmp_path / "src")
    pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=32)
    loaded = load_awq_model(tmp_path / "dst", dtype=torch.float32).generation_config
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "src").generation_config
    assert loaded.eos_token_id == expected.eos_token_id == [1, 7]
    assert (loaded.do_sample, loaded.temperature) == (expected.do_sample, expected.temperature) == (True, 0.6)


def test_other_quantizations_are_refused(tmp_path):
    make_tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a 4-bit AWQ GEMM checkpoint"):
        load_awq_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                     "version": "gemv"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="version"):
        load_awq_model(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="the oracle is gptqmodel's AWQ kernel")
def test_gptqmodel_reads_the_layout_as_we_do(tmp_path):
    """An independent reader of the format: transformers + gptqmodel load the packed checkpoint with their own AWQ
    layers; swapping them for AwqInt4Linear (``replace_awq_linears``) and loading without gptqmodel both give
    gptqmodel's logits (its CPU kernel multiplies in bfloat16: 0.3% apart, where a wrong nibble order or zero point
    would be 100%). The int4 layers run the interpreted Triton kernel (gptqmodel imports Triton: the interpreter
    setting conftest made at start-up must stay)."""
    make_tiny_model("qwen2").save_pretrained(tmp_path / "src")
    pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=32)
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits

    expected = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32))
    swapped = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32)
    assert replace_awq_linears(swapped) == 14
    for got in (logits(swapped), logits(load_awq_model(tmp_path / "dst", dtype=torch.float32))):
        assert (got - expected).abs().max() <= 0.01 * expected.abs().max()
