"""``attn_implementation="kvboost"`` under ``torch.compile(fullgraph=True, dynamic=False)``: the attention function
traces without a graph break, with the routing of its eager calls, and the Triton kernel runs inside the graph as
the custom op ``kvboost::flash_attention`` (its fake implementation gives the traced shapes, its real one runs).

The kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set by the test session) wherever the CPU
route to SDPA is turned off; a spy on the launcher records what the kernel served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from conftest import TINY
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, Qwen2Config

from kvboost_hf import ChunkReuseCache, ChunkStore
from kvboost_hf.hf import attention
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder
from kvboost_hf.hf.prefill import forward
from kvboost_hf.store.config import StoreConfig

ATOL = 1e-5  # fp32 logits: the same kernels run eagerly and in the graph
Call = tuple[int, int, bool]  # (queries, keys, mask is None) of one attention call


@pytest.fixture(autouse=True)
def interpreted(triton_interpreter) -> Iterator[None]:
    """The kernel runs interpreted; each test starts with no compiled graph and ends leaving none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def model() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**TINY), attn_implementation="kvboost").eval()


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Call]]:
    """The attention calls each route served, by route: ``"sdpa"`` (transformers' sdpa function: plain calls and
    fallbacks) and ``"grouped"`` (the CPU's SDPA over grouped K/V) recorded by spies the attention function calls
    (traced with it: dynamo replays their records at each run of a graph), ``"kernel"`` by a spy on the launcher
    the custom op's implementation calls."""
    served: dict[str, list[Call]] = {"sdpa": [], "grouped": [], "kernel": []}
    launcher = attention._kernel()

    def spy(name: str, function: Callable[..., Any], first: int) -> Callable[..., Any]:
        """``function`` recording its call: query and key are its positional arguments from ``first`` on, then the
        mask (positional or ``mask=``)."""

        def record(*args: Any, **kwargs: Any) -> Any:
            query, key, _, *rest = args[first:]
            mask = rest[0] if rest else kwargs.get("mask")
            served[name].append((query.shape[2], key.shape[2], mask is None))
            return function(*args, **kwargs)

        return record

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy("sdpa", attention.sdpa_attention_forward, 1))
    monkeypatch.setattr(attention, "_grouped_sdpa", spy("grouped", attention._grouped_sdpa, 0))
    kernel = spy("kernel", launcher, 0)
    monkeypatch.setattr(attention, "_kernel", lambda: kernel)
    return served


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))


def _forwards_over_a_cache(model: PreTrainedModel, step: object) -> list[torch.Tensor]:
    """Logits of ``step`` (the model's forward, eager or compiled) run on 5 new tokens over a 12-token cache, then
    on one token over the 17: queries shorter than the keys (a warm prompt's tail, a decode step). The 12-token
    prefix is forwarded eagerly."""
    ids = _prompt(18)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :12], cache=cache, use_cache=True)
        return [step(input_ids=ids[:, a:b], cache=cache, use_cache=True).logits for a, b in ((12, 17), (17, 18))]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("route", ["cpu", "kernel"])
def test_a_compiled_forward_over_a_cache_matches_eager_with_its_routing(
    model: PreTrainedModel,
    routes: dict[str, list[Call]],
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    route: str,
) -> None:
    """fullgraph compile of the forward, on the CPU's route (SDPA over grouped K/V) and on the kernel's (the
    custom op, interpreted): the eager logits, each call served as eagerly: the 5-token tail bottom-right causal
    without a mask (by the kernel, or the CPU's SDPA), the decode step by transformers' sdpa without one."""
    monkeypatch.setattr(attention, "ROUTE_CPU_TO_SDPA", route == "cpu")
    expected = _forwards_over_a_cache(model, model.forward)
    layers = TINY["num_hidden_layers"]
    tail = "grouped" if route == "cpu" else "kernel"
    eager = {name: calls.copy() for name, calls in routes.items()}
    assert eager[tail][-layers:] == [(5, 17, True)] * layers
    assert eager["sdpa"][-layers:] == [(1, 18, True)] * layers
    for calls in routes.values():
        calls.clear()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    for logits, reference in zip(_forwards_over_a_cache(model, compiled), expected, strict=True):
        torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
    assert routes == eager


def test_a_compiled_fallback_traces_and_logs_only_when_run_eagerly(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A dtype the kernel lacks (fp64) falls back to transformers' sdpa: its one-time warning is an eager call's;
    the traced call (fullgraph) takes the same fallback without logging."""
    monkeypatch.setattr(attention, "ROUTE_CPU_TO_SDPA", False)
    model = model.double()
    attention._log_fallback.cache_clear()
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        logits = _forwards_over_a_cache(model, compiled)
        assert not [r for r in caplog.records if r.name == attention.__name__]
        expected = _forwards_over_a_cache(model, model.forward)
    for got, reference in zip(logits, expected, strict=True):
        torch.testing.assert_close(got, reference, atol=1e-10, rtol=0)
    assert [r.getMessage() for r in caplog.records if r.name == attention.__name__] == [
        "kvboost attention falls back to torch SDPA: dtype torch.float64 is not supported"
    ]


def test_graphed_decode_steps_over_a_static_reuse_cache_run_the_kernel_in_the_graph(
    model: PreTrainedModel, routes: dict[str, list[Call]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """:class:`GraphedDecoder` (``torch.compile`` of the forward, fullgraph) over a static ChunkReuseCache: every
    step runs graphed (none falls back to eager after a failed compile), the kernel serving each layer's masked
    query over the cache's capacity, with the eager steps' tokens."""
    monkeypatch.setattr(attention, "ROUTE_CPU_TO_SDPA", False)
    steps, capacity = 4, 64
    ids = _prompt(20)

    def decode(decoder: GraphedDecoder) -> list[int]:
        cache = ChunkReuseCache(
            ChunkStore(StoreConfig(1 << 24)), model, 16, mode="baseline", adapter=False, write_back=False,
            max_cache_len=capacity,
        )  # fmt: skip
        with torch.no_grad():
            token = forward(model, cache, input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            tokens = [int(token)]
            for step in range(steps):
                logits = decoder.step(cache, token, torch.tensor([[ids.shape[1] + step]]))
                cache.record(token)
                token = logits.argmax(-1, keepdim=True)
                tokens.append(int(token))
        return tokens

    expected = decode(GraphedDecoder(model, GraphConfig(enabled=False)))
    routes["kernel"].clear()
    decoder = GraphedDecoder(model, GraphConfig(backend="eager"))
    assert decode(decoder) == expected
    assert (decoder.graphed_steps, decoder.eager_steps, decoder.failed_shapes) == (steps, 0, set())
    assert routes["kernel"][-1] == (1, capacity, False)


@pytest.mark.parametrize("masking", ["causal", "bool", "float"])
def test_the_custom_op_passes_opcheck(masking: str) -> None:
    """``torch.library.opcheck``: the op's schema, its fake implementation (shape, dtype, strides) against the real
    one, and its tracing (make_fx, AOT dispatch with static and dynamic shapes), with GQA and each kind of mask."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 16, generator=generator)
    key, value = (torch.randn(2, 2, 21, 16, generator=generator) for _ in range(2))
    allowed = torch.rand(2, 1, 5, 21, generator=generator) > 0.3
    mask = {
        "causal": None,
        "bool": allowed,
        "float": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
    }[masking]
    torch.library.opcheck(attention.flash_attention_op, (query, key, value, mask, 0.3, mask is None))
