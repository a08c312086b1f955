"""Whole tiny models with ``attn_implementation="kvboost"`` against ``"sdpa"`` on the same weights.

The kernel runs under the Triton interpreter; a spy on the launcher proves it served the calls. The fallback
(CPU tensors without the interpreter) is checked too, including prefill on top of a cache, whose ``None`` mask
means bottom-right causal alignment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import TINY
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from kvboost_hf.hf import attention
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig

ATOL = 1e-4  # fp32 logits
CONFIGS: dict[str, Callable[[], object]] = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY),
}


@pytest.fixture(autouse=True)
def interpreted(triton_interpreter) -> None:
    """Every test here runs the kernel under the Triton interpreter (one test unsets it again)."""


@pytest.fixture(params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    attention.register_kvboost_attention()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[request.param](), attn_implementation="kvboost").eval()


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts launches of the Triton kernel made through the attention function (every supported call goes to the
    kernel: plain prefill and decode too, which are routed to SDPA otherwise)."""
    calls: list[int] = []
    launcher = attention._kernel()
    assert launcher is not None

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(attention, "_kernel", lambda: spy)
    monkeypatch.setattr(attention, "ROUTE_PLAIN_TO_SDPA", False)
    monkeypatch.setattr(attention, "ROUTE_CPU_TO_SDPA", False)
    yield calls


def _generate(
    model: PreTrainedModel, impl: str, ids: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
    return out.sequences, torch.stack(out.logits)


def _forward_logits(model: PreTrainedModel, impl: str, **kwargs: object) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**kwargs).logits


def _prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def test_selected_by_name(model: PreTrainedModel) -> None:
    assert model.config._attn_implementation == "kvboost"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("kvboost")
    assert model.config._attn_implementation == "kvboost"


def test_greedy_generation_matches_sdpa(model: PreTrainedModel, kernel_calls: list[int]) -> None:
    ids = _prompt(1, 21)
    ref_tokens, ref_logits = _generate(model, "sdpa", ids)
    tokens, logits = _generate(model, "kvboost", ids)
    assert kernel_calls, "the Triton kernel was not used"
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_left_padded_batch_matches_sdpa(model: PreTrainedModel, kernel_calls: list[int]) -> None:
    ids = _prompt(3, 13)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    ref_tokens, ref_logits = _generate(model, "sdpa", ids, attention_mask=mask)
    tokens, logits = _generate(model, "kvboost", ids, attention_mask=mask)
    assert kernel_calls
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def _prefill_on_cache(model: PreTrainedModel, impl: str) -> torch.Tensor:
    """Logits of 7 tokens forwarded on top of a 12-token cache (Lq < Lk)."""
    ids = _prompt(1, 19)
    cache = DynamicCache(config=model.config)
    _forward_logits(model, impl, input_ids=ids[:, :12], cache=cache, use_cache=True)
    return _forward_logits(model, impl, input_ids=ids[:, 12:], cache=cache, use_cache=True)


def test_prefill_on_cache_matches_sdpa(model: PreTrainedModel, kernel_calls: list[int]) -> None:
    ref = _prefill_on_cache(model, "sdpa")
    torch.testing.assert_close(_prefill_on_cache(model, "kvboost"), ref, atol=ATOL, rtol=0)
    assert kernel_calls


def test_explicit_4d_float_mask_with_scattered_positions(model: PreTrainedModel, kernel_calls: list[int]) -> None:
    """A repair-style forward: caller-built 0/-inf mask [B, 1, Lq, Lk] and non-contiguous position ids."""
    num_q = 6
    positions = torch.tensor([[1, 4, 5, 9, 13, 14], [0, 2, 3, 7, 8, 15]])
    allowed = positions[:, None, :, None] >= positions[:, None, None, :]
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    kwargs = {"input_ids": _prompt(2, num_q), "attention_mask": mask, "position_ids": positions}
    ref = _forward_logits(model, "sdpa", **kwargs)
    torch.testing.assert_close(_forward_logits(model, "kvboost", **kwargs), ref, atol=ATOL, rtol=0)
    assert kernel_calls


def test_chunk_reuse_cache_matches_sdpa(model: PreTrainedModel, kernel_calls: list[int]) -> None:
    """Two generations on one store: the second stitches stored chunks and must still match sdpa."""
    ids = _prompt(1, 40)
    ref_tokens, ref_logits = _generate(model, "sdpa", ids)
    store = ChunkStore(StoreConfig(max_bytes=1 << 24))
    for run in range(2):
        cache = ChunkReuseCache(store, model, chunking=16)
        tokens, logits = _generate(model, "kvboost", ids, cache=cache)
        assert torch.equal(tokens, ref_tokens), f"run {run}"
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert cache.last_reuse[0].cached_tokens > 0, "the second run reused no chunk"
    assert kernel_calls


def test_sliding_window_with_padding_matches_sdpa(kernel_calls: list[int]) -> None:
    """Mistral with a window shorter than the prompt: sdpa's sliding-window mask reaches the kernel as a 4D mask."""
    attention.register_kvboost_attention()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**TINY, sliding_window=8), attn_implementation="sdpa")
    ids = _prompt(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ref_tokens, ref_logits = _generate(model.eval(), "sdpa", ids, attention_mask=mask)
    tokens, logits = _generate(model, "kvboost", ids, attention_mask=mask)
    assert kernel_calls
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_softcapped_attention_runs_the_models_eager_attention(caplog: pytest.LogCaptureFixture) -> None:
    """Gemma2 passes ``softcap`` to attention, which SDPA lacks: ``"kvboost"`` (the loader's choice on the CPU)
    raised transformers' "sdpa does not support softcap". It runs the model's eager attention, with the causal and
    sliding-window masks made additive, and equals ``"eager"`` with left padding and over a cache."""
    attention.register_kvboost_attention()
    torch.manual_seed(0)
    config = Gemma2Config(**TINY, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = _prompt(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ref_tokens, ref_logits = _generate(model, "eager", ids, attention_mask=mask)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        tokens, logits = _generate(model, "kvboost", ids, attention_mask=mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert "the model's eager attention" in caplog.text
    plain = ids[:1]
    expected = _forward_logits(model, "eager", input_ids=plain)
    for impl in ("eager", "kvboost"):  # a prefill over a cache: the bottom-right causal mask
        cache = DynamicCache(config=model.config)
        _forward_logits(model, impl, input_ids=plain[:, :12], cache=cache)
        tail = _forward_logits(model, impl, input_ids=plain[:, 12:], cache=cache)
        torch.testing.assert_close(tail, expected[:, 12:], atol=ATOL, rtol=0)


def test_cpu_without_interpreter_reads_grouped_kv_in_place_and_matches_sdpa(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CPU tensors (the default route, even with TRITON_INTERPRET=1): torch SDPA serves the masked calls
    (bottom-right causal on a cache) with the 2 K/V heads of the 4 query heads as they are (no expanded copy),
    equal to transformers' sdpa; it is the CPU's path, not a fallback: nothing is logged. A padded batch (an
    explicit 4D mask) takes it too."""
    ref = _prefill_on_cache(model, "sdpa")
    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append((query.shape[1], key.shape[1], bool(kwargs.get("enable_gqa"))))
        return sdpa(query, key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attention._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        out = _prefill_on_cache(model, "kvboost")
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (4, 2, True) in calls, calls
    assert not [r for r in caplog.records if r.name == attention.__name__]
    ids = _prompt(2, 10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    ref_tokens, ref_logits = _generate(model, "sdpa", ids, attention_mask=mask)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    calls.clear()
    tokens, logits = _generate(model, "kvboost", ids, attention_mask=mask)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert (4, 2, True) in calls, calls


def test_plain_prefill_and_decode_go_to_sdpa_and_prefill_on_a_cache_to_the_kernel(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default routing, the kernel runs only where SDPA would need a materialised mask."""
    shapes: list[tuple[int, int]] = []
    launcher = attention._kernel()
    assert launcher is not None

    def spy(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append((query.shape[2], key.shape[2]))
        return launcher(query, key, *args, **kwargs)

    monkeypatch.setattr(attention, "_kernel", lambda: spy)
    monkeypatch.setattr(attention, "ROUTE_CPU_TO_SDPA", False)
    ids = torch.randint(1, 100, (1, 12))
    with torch.no_grad():
        out = model(ids, use_cache=True)  # plain prefill: SDPA
        assert shapes == []
        model(ids[:, :1], cache=out.past_key_values, use_cache=True)  # one query: SDPA
        assert shapes == []
        model(ids[:, :5], cache=out.past_key_values, use_cache=True)  # 5 queries over 18 keys: kernel
    assert shapes and all(shape == (5, 18) for shape in shapes)


def test_the_loader_picks_kvboost_for_a_model_that_runs_on_the_cpu_only() -> None:
    """``load_model_and_tokenizer``: "kvboost" for a CPU model; transformers' default (sdpa) for one loaded on the
    CPU to run elsewhere (a layer-streamed model); a caller's choice wins."""
    from kvboost_hf.hf.models import load_model_and_tokenizer

    on_cpu, _ = load_model_and_tokenizer(None)
    assert on_cpu.config._attn_implementation == attention.ATTN_IMPLEMENTATION
    streamed, _ = load_model_and_tokenizer(None, runs_on=torch.device("cuda"))
    assert streamed.config._attn_implementation == "sdpa"
    chosen, _ = load_model_and_tokenizer(None, attn_implementation="eager")
    assert chosen.config._attn_implementation == "eager"
