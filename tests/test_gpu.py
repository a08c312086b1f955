"""GPU-only tests (``pytest -m gpu``): the compiled Triton kernel, layer streaming, chunk reuse and speculative
decoding on CUDA, each against a reference that does not use the path under test (SDPA, a resident model, plain
greedy). Skipped without CUDA. ``python -m kvboost_hf.bench gpu`` runs them with ``TRITON_INTERPRET=0``: the
kernel tests refuse to run interpreted (conftest turns the interpreter on unless the variable is set).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import explode_once, greedy, make_tiny_model

from kvboost_hf import ChunkReuseCache, ChunkStore
from kvboost_hf.hf.speculative import DraftConfig
from kvboost_hf.offload import LayerStreamingConfig, decoder_layers, enable_layer_streaming
from kvboost_hf.store.config import StoreConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
CUDA = torch.device("cuda")
CHUNK = 16
LAYERS = 7  # odd: odd streamed counts below
# ||out - ref|| / ||ref|| against float64: fp16/bf16 operands and P rounded to the dtype before P @ V
RELATIVE_ERROR = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def compiled_kernel():
    """The compiled (not interpreted) kernel launcher."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("GPU kernel tests need the compiled kernel: run them with TRITON_INTERPRET=0")
    pytest.importorskip("triton")
    from kvboost_hf.kernels.flash_attention import flash_attention

    return flash_attention


@pytest.fixture
def kernel_calls(monkeypatch, compiled_kernel):
    """Counts the kernel launches made through ``attn_implementation="kvboost"`` (0 would mean SDPA fallback)."""
    from kvboost_hf.hf import attention

    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return compiled_kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "_kernel", lambda: counting)
    monkeypatch.setattr(attention, "ROUTE_PLAIN_TO_SDPA", False)  # every call through the kernel
    return calls


def _qkv(batch, heads, heads_kv, num_q, num_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    shapes = [(batch, heads, num_q, head_dim), *[(batch, heads_kv, num_k, head_dim)] * 2]
    return [torch.randn(s, generator=gen, device=CUDA, dtype=dtype) for s in shapes]


def _sdpa_bottom_right(q, k, v):
    """SDPA with bottom-right causal alignment (queries are the last Lq keys), output ``[B, Lq, H, D]``."""
    num_q, num_k = q.shape[2], k.shape[2]
    visible = torch.arange(num_k, device=q.device)[None, :] <= torch.arange(num_q, device=q.device)[:, None] + (
        num_k - num_q
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q", "num_k"), [(1, 1000), (37, 517), (257, 257), (300, 4099)])
def test_compiled_kernel_matches_sdpa(compiled_kernel, head_dim, dtype, num_q, num_k):
    """Causal with Lq <= Lk (decode, prefill on a cache, plain prefill), GQA 8/2, odd lengths: the kernel's
    relative error against float64 SDPA is that of rounding to the dtype (a masking or head-mapping error is
    O(0.1)), and every output element is finite."""
    q, k, v = _qkv(2, 8, 2, num_q, num_k, head_dim, dtype, seed=num_q + head_dim)
    expected = _sdpa_bottom_right(q.double(), k.double(), v.double())
    out = compiled_kernel(q, k, v)
    assert out.shape == (2, num_q, 8, head_dim) and out.dtype == dtype and torch.isfinite(out).all()
    kernel_error = (out.double() - expected).norm() / expected.norm()
    sdpa_error = (_sdpa_bottom_right(q, k, v).double() - expected).norm() / expected.norm()
    assert kernel_error < RELATIVE_ERROR[dtype], f"kernel {kernel_error:.2e}, SDPA in {dtype} {sdpa_error:.2e}"


def _kvboost_and_sdpa_models(dtype):
    model = make_tiny_model("qwen2", num_hidden_layers=3).to(CUDA, dtype)
    reference = make_tiny_model("qwen2", num_hidden_layers=3).to(CUDA, dtype)
    model.set_attn_implementation("kvboost")
    return model, reference


def test_generate_with_kvboost_attention_equals_sdpa(kernel_calls):
    model, reference = _kvboost_and_sdpa_models(torch.float32)
    ids = torch.randint(1, 128, (2, 45), generator=torch.Generator().manual_seed(1)).to(CUDA)
    expected, expected_logits = greedy(reference, ids, new=12)
    got, logits = greedy(model, ids, new=12)
    assert kernel_calls[0] > 0, "the kvboost kernel never ran (SDPA fallback)"
    assert torch.equal(got, expected)
    torch.testing.assert_close(logits, expected_logits, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_embedded_model_greedy_kvboost_equals_sdpa(kernel_calls):
    from transformers import AutoModelForCausalLM

    from kvboost_hf.hf.models import embedded_model_dir

    try:
        path = embedded_model_dir()
    except FileNotFoundError as exc:  # its 98 MB GGUF does not fit in a device call's 64 MiB
        pytest.skip(str(exc))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="kvboost")
    ids = torch.tensor([[1, 504, 3458, 314, 253, 2849, 282, 1046, 30, 378, 3458, 314]], device=CUDA)
    expected, _ = greedy(reference.to(CUDA).eval(), ids, new=16)
    got, _ = greedy(model.to(CUDA).eval(), ids, new=16)
    assert kernel_calls[0] > 0
    assert torch.equal(got, expected)


def _streamed_pair(**settings):
    resident = make_tiny_model("llama", num_hidden_layers=LAYERS).to(CUDA)
    streamed = make_tiny_model("llama", num_hidden_layers=LAYERS)
    handle = enable_layer_streaming(streamed, LayerStreamingConfig(device=CUDA, **settings))
    return resident, streamed, handle


def _prompt(length=40, seed=0):
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed)).to(CUDA)


@pytest.mark.parametrize(("first", "last", "slots"), [(0, 0, 2), (0, 2, 2), (1, 1, 3), (2, 1, 1)])
def test_streamed_on_cuda_equals_resident(first, last, slots):
    """Pinned host copies, the side copy stream and events: same tokens and bitwise the same logits."""
    resident, streamed, handle = _streamed_pair(keep_first_k=first, keep_last_k=last, num_slots=slots)
    assert handle.streamed_indices == list(range(first, LAYERS - last))
    assert all(layer.host.is_pinned() for layer in handle.layers)
    assert all(slot.device.type == "cuda" for slot in handle.slots)
    expected, expected_logits = greedy(resident, _prompt())
    got, logits = greedy(streamed, _prompt())
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    assert handle.stats().forwards > 0


def test_exception_mid_forward_on_cuda_then_identical_generation():
    resident, streamed, handle = _streamed_pair(keep_first_k=0, keep_last_k=1, num_slots=2)
    explode_once(decoder_layers(streamed)[3].self_attn, "stop inside layer 3")
    with pytest.raises(RuntimeError, match="stop inside layer 3"):
        streamed(_prompt())
    expected, expected_logits = greedy(resident, _prompt())
    got, logits = greedy(streamed, _prompt())
    assert torch.equal(got, expected) and torch.equal(logits, expected_logits)
    assert handle.stats().reloads >= 1


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_chunk_reuse_on_cuda_exact_and_through_the_disk(tmp_path, tier):
    """The second request reuses every full chunk (from RAM, or from disk after the RAM tier is emptied): tokens
    identical to plain greedy, K/V back on the GPU."""
    model = make_tiny_model("llama", num_hidden_layers=3).to(CUDA)
    ids = _prompt(3 * CHUNK + 5)
    expected, expected_logits = greedy(model, ids)
    store = ChunkStore(StoreConfig(1 << 26, disk_cache_dir=tmp_path if tier == "disk" else None))
    greedy(model, ids, ChunkReuseCache(store, model, CHUNK))
    if tier == "disk":
        store.flush()  # the chunks written back land in RAM and on disk
        store.ram.clear()
    cache = ChunkReuseCache(store, model, CHUNK)
    got, logits = greedy(model, ids, cache)
    assert cache.last_reuse[0].cached_tokens == 3 * CHUNK
    assert cache.layers[0].keys.device.type == "cuda"
    assert torch.equal(got, expected)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree_budget", [0, 8], ids=["chain", "tree"])
def test_speculative_with_streamed_target_equals_greedy(tree_budget):
    """Early-exit drafts (a chain, and a tree verified in one forward with a 4D mask) on a target whose layers
    stream from pinned host memory: the output is the greedy output of the same weights, resident on the GPU (a
    copy of the target made before streaming: a second random model drawn on the GPU would hold other weights)."""
    from kvboost_hf.bench.shapes import engine_copy, random_engine, tokenizer_dir

    try:
        tokenizer_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"no tokenizer for the random-shape engine: {exc}")
    target = random_engine("tiny", device="cpu", chunking=CHUNK, draft=DraftConfig(3, early_exit_layers=1))
    plain = engine_copy(target, device=CUDA, chunking=CHUNK)
    weights = zip(plain.model.state_dict().values(), target.model.state_dict().values(), strict=True)
    assert all(torch.equal(on_gpu.cpu(), on_cpu) for on_gpu, on_cpu in weights)
    prompt = "The quick brown fox jumps over the lazy dog."
    expected = plain.generate(prompt, 16, mode="baseline").output_ids
    ids = plain.encode(prompt)
    sequences, _ = greedy(plain.model, torch.tensor([ids], device=CUDA), new=16)
    assert sequences[0, len(ids) : len(ids) + len(expected)].tolist() == expected  # transformers' own generate()
    target.draft_settings = DraftConfig(num_draft_tokens=3, early_exit_layers=1, tree_budget=tree_budget)
    enable_layer_streaming(target.model, LayerStreamingConfig(keep_first_k=1, device=CUDA))
    got = target.generate(prompt, 16, mode="baseline")
    assert got.output_ids == expected
    assert got.streamed_bytes is not None and got.streamed_bytes > 0
