"""The round-to-nearest AWQ GEMM packer, checked against a literal reading of the format (no gptqmodel needed),
and a packed checkpoint loaded through transformers + gptqmodel, streamed vs resident (slow, needs the awq extra)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from conftest import make_tiny_model
from oracle import engine_reference
from safetensors.torch import load_file

from kvboost_hf.core.errors import ConfigError, InputError
from kvboost_hf.kernels.awq_linear import AwqInt4Linear
from kvboost_hf.kernels.awq_reference import AWQ_ORDER, unpack_int4
from kvboost_hf.tools.awq_load import load_awq_model
from kvboost_hf.tools.awq_pack import (
    dequantize_linear,
    int4_model,
    main,
    pack_checkpoint,
    pack_int4,
    quantize_linear,
    round_trip_int4,
)


def reference_dequantize(qweight, qzeros, scales, group_size):
    """The AWQ GEMM format read element by element: nibble j of word [i, c] is column 8c + AWQ_ORDER[j]."""
    rows, words = qweight.shape
    out = torch.empty(rows, words * 8, dtype=torch.float64)
    for i in range(rows):
        for c in range(words):
            word, zero_word = int(qweight[i, c]) & 0xFFFFFFFF, int(qzeros[i // group_size, c]) & 0xFFFFFFFF
            for j, column in enumerate(AWQ_ORDER):
                code, zero = (word >> 4 * j) & 15, (zero_word >> 4 * j) & 15
                out[i, 8 * c + column] = (code - zero) * float(scales[i // group_size, 8 * c + column])
    return out.t()


def test_nibble_order_and_sign_of_the_packed_word():
    packed = pack_int4(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    expected = sum(v << 4 * j for j, v in enumerate([1, 3, 5, 7, 2, 4, 6, 8]))  # columns 0,2,4,6,1,3,5,7
    assert packed.dtype == torch.int32 and int(packed) & 0xFFFFFFFF == expected and int(packed) < 0
    codes = torch.randint(0, 16, (5, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("group_size", [32, 64])
def test_quantization_is_round_to_nearest_within_half_a_step(group_size):
    weight = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    weight[:8, :group_size] = weight[:8, :group_size].abs()  # one-signed groups keep zero representable
    packed = quantize_linear(weight, group_size)
    assert packed["qweight"].shape == (128, 5) and packed["qzeros"].shape == (128 // group_size, 5)
    assert packed["scales"].shape == (128 // group_size, 40) and packed["scales"].dtype == torch.float16
    restored = dequantize_linear(packed["qweight"], packed["qzeros"], packed["scales"], group_size)
    reference = reference_dequantize(packed["qweight"], packed["qzeros"], packed["scales"], group_size)
    assert torch.allclose(restored.double(), reference, atol=1e-6)
    step = packed["scales"].float().repeat_interleave(group_size, dim=0).t()
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(quantize_linear(restored, group_size)["qweight"], packed["qweight"])  # grid values are fixed


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not divisible by group_size"):
        quantize_linear(torch.randn(8, 100), 64)
    with pytest.raises(ValueError, match="not divisible by 8"):
        quantize_linear(torch.randn(12, 64), 64)


def test_packed_tiny_checkpoint_dequantizes_to_its_weights(tmp_path):
    model = make_tiny_model("llama")
    model.save_pretrained(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--group-size", "32"]) == 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    packed = load_file(tmp_path / "dst" / "model.safetensors")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    assert len(linears) == 2 * 7
    for name in linears:
        weight = model.get_submodule(name).weight
        triple = [packed.pop(f"{name}.{key}") for key in ("qweight", "qzeros", "scales")]
        restored = reference_dequantize(*triple, 32).float()
        step = triple[2].float().repeat_interleave(32, dim=0).t()
        assert ((restored - weight).abs() <= step / 2 + 1e-6).all(), name
    state = model.state_dict()
    assert "lm_head.weight" in packed and "model.embed_tokens.weight" in packed  # kept, not quantized
    for key, tensor in packed.items():
        assert tensor.dtype == torch.float16 and torch.equal(tensor, state[key].half()), key
    with pytest.raises(FileExistsError):
        main([str(tmp_path / "src"), str(tmp_path / "dst")])
    with pytest.raises(ValueError, match="already quantized"):
        main([str(tmp_path / "dst"), str(tmp_path / "again")])


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gptqmodel") is None,
    reason="loading AWQ checkpoints needs gptqmodel: pip install -e '.[awq]'",
)
def test_packed_embedded_model_streamed_equals_resident(tmp_path):
    from kvboost_hf import KVBoost, LayerStreamingConfig
    from kvboost_hf.hf.models import embedded_model_dir
    from kvboost_hf.offload import decoder_layers, layer_streamer

    main([str(embedded_model_dir()), str(tmp_path / "awq")])
    engine = KVBoost.from_pretrained(
        tmp_path / "awq",
        dtype=torch.float16,
        chunking=64,
        streaming=LayerStreamingConfig(keep_first_k=1, keep_last_k=2),
    )
    assert "Awq" in type(decoder_layers(engine.model)[5].self_attn.q_proj).__name__
    prompt = "The capital of France is"
    streamed = [engine.generate(prompt, 8, mode=mode).output_ids for mode in ("baseline", "chunk_kv_reuse")]
    stats = layer_streamer(engine.model).stats()
    assert stats.streamed_layers == 27 and stats.last_forward_bytes == stats.bytes_per_forward > 0
    layer_streamer(engine.model).close()  # the same model, now resident
    expected = engine_reference(engine, prompt, 8).tokens  # transformers' generate() on the resident int4 model
    assert "Paris" in engine.tokenizer.decode(expected)
    assert streamed == [expected] * 2


def test_round_trip_gives_a_model_the_packed_int4_weights():
    """``round_trip_int4`` (the bench's ``rtn4`` draft): every decoder-layer linear weight becomes exactly what the
    packer stores for it, dequantized; embeddings, norms and the head stay as they were."""
    original = make_tiny_model("llama", seed=2)
    model = make_tiny_model("llama", seed=2)
    assert round_trip_int4(model, group_size=32) == 7 * original.config.num_hidden_layers  # q k v o gate up down
    for (name, before), after in zip(original.named_parameters(), model.parameters(), strict=True):
        if ".layers." in name and before.dim() == 2:
            packed = quantize_linear(before.detach(), 32)
            assert torch.equal(after, dequantize_linear(packed["qweight"], packed["qzeros"], packed["scales"], 32))
            assert not torch.equal(after, before), name
        else:
            assert torch.equal(after, before), name


@pytest.mark.parametrize("group_size", [0, -8, 8, 12, 16.0, True])
def test_every_int4_path_refuses_a_group_size_the_kernel_cannot_run(group_size):
    """A power of two >= 16 everywhere (pack_checkpoint took 8, which only the CPU path could run; 0 raised
    ZeroDivisionError)."""
    with pytest.raises(ConfigError, match="group_size must be a power of two >= 16"):
        int4_model(make_tiny_model("llama"), group_size)
    with pytest.raises(ConfigError, match="group_size must be a power of two >= 16"):
        AwqInt4Linear(64, 64, group_size)


def test_a_model_that_cannot_be_packed_is_left_as_it_was():
    """Every layer is checked before any is replaced (a failure left 6 of 14 linears converted)."""
    model = make_tiny_model("llama", intermediate_size=96)  # the MLP's down projection has 96 inputs
    before = {name: type(module) for name, module in model.named_modules()}
    with pytest.raises(InputError, match="nothing was replaced"):
        int4_model(model, 64)
    assert {name: type(module) for name, module in model.named_modules()} == before


TINY_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 8, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "head_dim": 16}),
}


@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
def test_mixture_of_experts_models_are_refused_by_every_int4_path(tmp_path, model_type):
    """Routers and gates were quantized like projections (Qwen2-MoE's one-output gate refused the model) and fused
    experts stayed float or failed to load: every path now refuses a mixture of experts up front, naming it."""
    config_name, model_name, extra = TINY_MOE[model_type]
    config = getattr(transformers, config_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_experts_per_tok=2, moe_intermediate_size=32, **extra,
    )  # fmt: skip
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(tmp_path / "src")
    refused = pytest.raises(ConfigError, match=f"{model_type} is a mixture-of-experts model")
    with refused:
        pack_checkpoint(tmp_path / "src", tmp_path / "dst", group_size=16)
    assert not (tmp_path / "dst").exists()
    with refused:
        int4_model(model, 16)
    with refused:
        round_trip_int4(model, 16)
    assert not any(isinstance(module, AwqInt4Linear) for module in model.modules())
    settings = json.loads((tmp_path / "src" / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
                                       "version": "gemm"}  # fmt: skip
    (tmp_path / "src" / "config.json").write_text(json.dumps(settings))
    with refused:
        load_awq_model(tmp_path / "src")
