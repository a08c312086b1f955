"""Shared fixtures: tiny random models of each supported architecture, and the embedded model's engine."""

from __future__ import annotations

import os

# Triton decides interpretation when it is first imported (its standard library is @jit-decorated then), and
# transformers can import it early through torchao (pulled in by the awq extra): a per-test setting comes too late,
# so the interpreter is on for the session, set before any import. Tests that need it off unset it at run time
# (the attention function reads it per call); the real compile runs in a subprocess without it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import functools
import gc
import importlib
import sys
from types import ModuleType

import pytest
import torch
import transformers

# The suite starts dozens of Python processes (xdist workers, servers, fork servers, notebook kernels, Ray workers),
# most of them importing this package. Where bytecode writing is off (PYTHONDONTWRITEBYTECODE, which many container
# images set) each compiles the package's sources again (~0.4 s of CPU for all of them here) and each pytest process
# rewrites every test module's asserts again: measured here, a collection took 23.2-24.9 CPU-seconds without cached
# bytecode against 17.2-18.8 with it. So the suite's processes write it (to the git-ignored __pycache__ folders)
# whatever the caller's setting; a fresh clone's first run writes it, later runs and processes read it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads: by default every worker
# starts a thread per core, and n workers' threads on the same cores spin-wait for each other. The processes a test
# starts (notebook kernels, bench dry runs, Ray workers) inherit the share through OMP_NUM_THREADS.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    _CORE_SHARE = max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_CORE_SHARE))
    torch.set_num_threads(_CORE_SHARE)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
)

# name -> (config class, model class, extra config); Mistral gets a sliding window shorter than the prompts.
TINY_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 24}),
}
EAGER_ONLY = {"gemma2"}  # transformers has no SDPA path for Gemma2's soft-capped attention

#: The attention tests' tiny shape (test_attention_integration, test_attention_compile): 2 layers, 4 query heads
#: over 2 K/V heads, 256 positions.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # peaked logits: greedy choices are not near-ties
}

#: Tiny configs whose rotary frequencies depend on the sequence length (architecture, config overrides): longrope
#: switches to its long factors past 64 tokens, dynamic NTK rescales past 64 positions.
LENGTH_DEPENDENT = {
    "longrope": (
        "phi3",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0] * 8,
                "long_factor": [16.0] * 8,
            },
        },
    ),
    "dynamic": (
        "llama",
        {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "dynamic", "factor": 16.0, "rope_theta": 1e4}},
    ),
}


def make_tiny_model(name: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """A randomly initialised 2-layer model of architecture ``name`` in fp32, eval mode."""
    config_name, model_name, extra = TINY_ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = "eager" if name in EAGER_ONLY else "sdpa"
    return getattr(transformers, model_name)(config).eval()


def noisy_copy(model: transformers.PreTrainedModel, scale: float, seed: int) -> transformers.PreTrainedModel:
    """A copy of ``model`` with Gaussian noise of ``scale`` times each tensor's spread added to its weights: as a
    draft its proposals are the model's often, not always."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std().nan_to_num())
    return noisy


def explode_once(module: torch.nn.Module, message: str) -> None:
    """Make ``module``'s next forward raise ``RuntimeError(message)`` (only the next one)."""
    armed = [True]

    def explode(module: torch.nn.Module, args: tuple) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError(message)

    module.register_forward_pre_hook(explode)


@pytest.fixture(params=sorted(TINY_ARCHITECTURES))
def tiny_model(request: pytest.FixtureRequest) -> transformers.PreTrainedModel:
    return make_tiny_model(request.param)


@pytest.fixture(scope="module")
def target() -> transformers.PreTrainedModel:
    """A speculative test's target: the tiny Llama of seed 0 (one per module)."""
    return make_tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def draft(target: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """The target with noise on its weights: its proposals are often, not always, the target's choices."""
    return noisy_copy(target, 0.35, seed=11)


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> None:
    """What is alive when a module starts (torch's, transformers' and dynamo's objects: half a million and more) kept
    out of the cyclic garbage collector's sweeps from then on (``gc.freeze``). Each full sweep of them costs ~0.35 s
    on this machine, and they come often: automatic ones (4.6 s of 57 in test_engine and test_scheduling), and the
    ``gc.collect()`` after every graph a ``GraphedDecoder`` compiles. What a module makes is still swept and freed;
    a frozen object is still freed when its last reference goes."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish() -> None:
    """The frozen objects back to the collector, so the interpreter's exit frees their cycles (nanobind, under
    xgrammar, reports the instances it finds alive then as leaks)."""
    gc.unfreeze()


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine, loaded once per test session."""
    from kvboost_hf import KVBoost

    return KVBoost.from_pretrained(chunking=64)


_KERNEL_MODULE = "kvboost_hf.kernels.flash_attention"


@functools.cache
def _kernel_module_under_interpreter() -> ModuleType:
    """The kernel module, imported while TRITON_INTERPRET=1 (Triton picks interpretation when it decorates): reloaded
    when a test imported it before without the variable (tests that import every module of the package do)."""
    if _KERNEL_MODULE in sys.modules:
        return importlib.reload(sys.modules[_KERNEL_MODULE])
    return importlib.import_module(_KERNEL_MODULE)


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The kernel module, run on CPU under the interpreter (the variable is also set for this test explicitly, so a
    test that unsets it cannot leak into the next)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _kernel_module_under_interpreter()


@pytest.fixture
def probed_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.gpu.environment()`` without its probe subprocess (seconds of imports): a CPU machine's record, for
    campaign tests that do not look at it. The probe itself is checked by tests/test_gpu_campaign.py's dry run and
    its test without the embedded model."""
    from kvboost_hf.bench import gpu

    record = {"date_utc": "2026-01-01T00:00:00+00:00", "cuda_available": False, "tokenizer": None}
    monkeypatch.setattr(gpu, "environment", lambda: dict(record))


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server for one test (skipped where redis-server is not installed)."""
    import shutil

    from helpers import RedisServer

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/start-redis.sh installs it)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def remote(redis_server):
    """A RemoteTier on :func:`redis_server` with short timeouts (0.5 s per call, 0.2 s before a retry)."""
    from kvboost_hf.store.remote import RemoteTier

    tier = RemoteTier(redis_server.url, retry_after_s=0.2, timeout_s=0.5)
    yield tier
    tier.close(timeout_s=2)


def greedy(model, ids, cache=None, new=8, **kwargs):
    """Greedy ``generate()`` on ``cache`` (None: plain): the sequences and the stacked logits ``[B, new, V]``."""
    out = model.generate(
        ids,
        cache=cache,
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)
