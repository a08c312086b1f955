"""Random AWQ int4 shapes built in process (no checkpoint): reproducible packed bytes, the advertised weight scale,
and the same tokens streamed as resident."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy

from kvboost_hf.bench.shapes import random_awq_model
from kvboost_hf.kernels.awq_linear import AwqInt4Linear
from kvboost_hf.kernels.awq_reference import dequantize_awq
from kvboost_hf.offload import LayerStreamingConfig, decoder_layers, enable_layer_streaming


@pytest.fixture
def plain_torch(monkeypatch):
    """The int4 layers' plain-torch path (no interpreter): these tests are about the model, not the kernel."""
    monkeypatch.delenv("TRITON_INTERPRET")


def test_random_awq_model_is_seeded_int4_throughout(plain_torch):
    model = random_awq_model("tiny", device="cpu", dtype="float32", group_size=32)
    again = random_awq_model("tiny", device="cpu", dtype="float32", group_size=32)
    other = random_awq_model("tiny", device="cpu", dtype="float32", group_size=32, seed=1)
    state, same, changed = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not torch.equal(state["model.layers.0.mlp.up_proj.qweight"], changed["model.layers.0.mlp.up_proj.qweight"])
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    linears = [m for m in model.model.layers.modules() if isinstance(m, AwqInt4Linear)]
    assert len(linears) == 7 * 3 and not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    first, second = (decoder_layers(model)[i].mlp.up_proj.qweight for i in (0, 1))
    assert not torch.equal(first, second)  # every layer has codes of its own
    weight = dequantize_awq(linears[0].qweight, linears[0].qzeros, linears[0].scales, 32)
    assert 0.015 < weight.pow(2).mean().sqrt().item() < 0.025  # std 0.02, like transformers' initialisation
    rotary = model.model.rotary_emb
    assert torch.allclose(rotary.inv_freq, rotary.original_inv_freq) and rotary.inv_freq[0] == 1.0


def test_random_awq_model_streamed_equals_resident(plain_torch):
    resident = random_awq_model("tiny", device="cpu", dtype="float32", group_size=32)
    streamed = random_awq_model("tiny", device="cpu", dtype="float32", group_size=32)
    handle = enable_layer_streaming(streamed, LayerStreamingConfig(keep_first_k=1, num_slots=2))
    ids = torch.randint(1, 1000, (1, 7), generator=torch.Generator().manual_seed(0))
    expected, expected_logits = greedy(resident, ids, new=4)
    got, logits = greedy(streamed, ids, new=4)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    assert handle.stats().streamed_layers == 2
