"""Streamed int4: the layer streamer copies the packed AWQ tensors (qweight, qzeros, scales), never a dequantized
weight, and a streamed int4 model generates exactly what the resident int4 model generates (CPU: the same code as
CUDA with synchronous copies)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import greedy, make_tiny_model

from kvboost_hf.kernels.awq_linear import AwqInt4Linear
from kvboost_hf.offload import LayerStreamingConfig, decoder_layers, enable_layer_streaming
from kvboost_hf.tools.awq_pack import int4_model


def packed_layer_bytes(layer: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the layer's AWQ tensors, bytes of everything else it holds: norms)."""
    awq = sum(m.packed_bytes for m in layer.modules() if isinstance(m, AwqInt4Linear))
    rest = sum(p.numel() * p.element_size() for n, p in layer.named_parameters())
    return awq, rest


def int4_pair(model: torch.nn.Module, group_size: int, **settings):
    """The int4 copy of ``model`` resident, the same copy streamed, and the streamer's handle."""
    int4_model(model, group_size)
    return (model, *streamed_copy(model, **settings))


def streamed_copy(model: torch.nn.Module, **settings):
    """A copy of ``model`` streamed under ``settings`` (:class:`LayerStreamingConfig`'s), and the streamer's handle."""
    streamed = copy.deepcopy(model)
    return streamed, enable_layer_streaming(streamed, LayerStreamingConfig(**settings))


@pytest.fixture(scope="module")
def interpreted_reference() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 3-layer tiny Qwen2's int4 copy (group 32), resident; a prompt; its greedy tokens and logits (a prompt forward
    and a decode forward) through the interpreted kernel: the reference of each streamed layout below, computed once
    (each interpreted run of the model costs seconds)."""
    resident = make_tiny_model("qwen2", num_hidden_layers=3)
    int4_model(resident, 32)
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    return resident, ids, *greedy(resident, ids, new=2)


@pytest.mark.parametrize(("first", "last", "slots"), [(0, 0, 2), (1, 0, 3)])
def test_streamed_int4_equals_resident_through_the_interpreted_kernel(first, last, slots, interpreted_reference):
    """TRITON_INTERPRET=1 (set by conftest): every linear of both models runs the Triton kernel."""
    resident, ids, expected, expected_logits = interpreted_reference
    streamed, handle = streamed_copy(resident, keep_first_k=first, keep_last_k=last, num_slots=slots)
    got, logits = greedy(streamed, ids, new=2)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)

    stats = handle.stats()
    layers = decoder_layers(resident)[first:]
    awq, rest = map(sum, zip(*(packed_layer_bytes(layer) for layer in layers), strict=True))
    assert stats.bytes_per_forward == awq + rest  # the packed bytes and the norms: nothing dequantized
    assert stats.last_forward_bytes == stats.bytes_per_forward
    assert stats.bytes_streamed >= stats.forwards * stats.bytes_per_forward - stats.slot_bytes
    float_bytes = sum(4 * m.in_features * m.out_features for layer in layers for m in layer.modules()
                      if isinstance(m, AwqInt4Linear))  # fmt: skip
    assert awq < float_bytes / 6  # int4 + per-group scales/zeros against fp32
    slot_dtypes = {t.dtype for layer in handle.layers for t in layer.slot_views[0]}
    assert torch.int32 in slot_dtypes and slot_dtypes <= {torch.int32, torch.float16, torch.float32}


@pytest.mark.slow
def test_streamed_int4_equals_resident_on_the_embedded_model(embedded_engine, monkeypatch):
    """The embedded SmolLM2-135M's int4 copy (group 64), the plain-torch path (no interpreter: 30 layers)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    resident, streamed, handle = int4_pair(copy.deepcopy(embedded_engine.model), 64, keep_first_k=1, keep_last_k=1)
    ids = torch.tensor([embedded_engine.encode("Paris is")])
    expected, expected_logits = greedy(resident, ids, new=3)
    got, logits = greedy(streamed, ids, new=3)
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    stats = handle.stats()
    awq, rest = map(sum, zip(*(packed_layer_bytes(layer) for layer in decoder_layers(resident)[1:-1]), strict=True))
    assert stats.streamed_layers == 28 and stats.bytes_per_forward == awq + rest
