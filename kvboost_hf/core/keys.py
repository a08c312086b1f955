"""Stage 2: keys that name a chunk's K/V in the store.

* ``namespace``: SHA-256 of everything that changes K/V (model config and a digest of its weights, dtype,
  chunking settings, K/V quantization, library storage format) plus an optional tenant ``cache_salt``.
  Two models or settings sharing one store never read each other's entries.
* prefix key of chunk ``i`` = SHA-256(namespace, prefix key of chunk ``i - 1``, token bytes): names K/V
  computed with the chunk's real preceding text as past (exact reuse).
* content key = SHA-256(namespace, token bytes): names the chunk's text wherever it appears (non-prefix reuse).

Keys are 64-character lowercase hex strings, safe as file names and Redis keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvboost_hf.core.chunking import ChunkingConfig, Span
from kvboost_hf.core.errors import InputError

STORAGE_FORMAT_VERSION = 1
DIGEST_VERSION = 3  # 1: sampled weights; 2: xxh3-128 over every byte; 3: without non-persistent buffers
FULL_PRECISION_BITS = 16  # kv_cache_bits of K/V stored unquantized (the default of StoreConfig.kv_cache_bits)
_IGNORED_CONFIG_FIELDS = ("_name_or_path", "transformers_version", "_attn_implementation", "architectures")

_weight_digests: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]] = weakref.WeakKeyDictionary()
_held_digests: contextvars.ContextVar[dict[tuple[int, str | None], str] | None] = contextvars.ContextVar(
    "held_model_digests", default=None
)


@contextlib.contextmanager
def digests_held() -> Iterator[None]:
    """Within the block, :func:`model_digest` checks each ``(model, model_id)`` once and then returns that digest
    (per thread or task: a context variable). For one request, whose cache, batch policy and draft each ask for the
    digest while the weights cannot change (the engine runs it under its lock): the check walks every module and
    tensor (~0.7 ms on a 28-layer model here), which it would otherwise repeat. Nested blocks share the outer one's
    digests."""
    if _held_digests.get() is not None:
        yield
        return
    token = _held_digests.set({})
    try:
        yield
    finally:
        _held_digests.reset(token)


def model_digest(model: torch.nn.Module, model_id: str | None = None) -> str:
    """Identity of a model: its config (minus paths and versions), its active PEFT adapters, and either a hash
    of every weight or the caller's ``model_id``.

    Weights: xxh3-128 over the raw bytes of every parameter and persistent buffer, with its name, shape and dtype (any
    changed byte, such as two swapped embedding rows, changes the digest). Cached per model object and
    recomputed when a tensor is added or removed (an adapter loaded), replaced (``param.data = ...``: its storage
    address changes) or changed in place through autograd's version counter (an optimizer step,
    ``load_state_dict``, a merged adapter, any in-place op on the parameter or a view of it). Writes that bypass
    the counter are not seen: through ``param.data`` (a detached alias with its own counter), NumPy/DLPack views
    or raw pointers; call :func:`forget_model_digest` after those. Cost: one pass over the weights (GPU weights
    are copied to the host tensor by tensor), measured by ``python -m kvboost_hf.bench tiers``; the cache check
    reads each tensor's version and address only.
    ``model_id``: for models versioned by their owner (a checkpoint name and revision): no weight is read, and
    two models given the same ``model_id`` and config share K/V, so it must change whenever the weights do.
    Raises ValueError if a weight is on the meta device (offloaded) and no ``model_id`` is given. Inside
    :func:`digests_held`, checked once per model.
    """
    held = _held_digests.get()
    if held is None:
        return _model_digest(model, model_id)
    key = (id(model), model_id)
    if key not in held:
        held[key] = _model_digest(model, model_id)
    return held[key]


def _model_digest(model: torch.nn.Module, model_id: str | None) -> str:
    h = hashlib.sha256(f"digest-v{DIGEST_VERSION}".encode())
    config = getattr(model, "config", None)
    if config is not None:
        fields = {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG_FIELDS}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    h.update(json.dumps(_adapter_state(model), sort_keys=True, default=str).encode())
    if model_id is not None:
        h.update(b"model_id\0" + model_id.encode())
    else:
        h.update(b"weights\0" + _weight_digest(model).encode())
    return h.hexdigest()


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers: what a checkpoint holds. Non-persistent buffers (a rotary ``inv_freq``)
    are derived from the config, and a length-dependent RoPE rewrites them at each forward, so they are left out:
    the digest does not change with the length of the last sequence the model saw."""
    parameters: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()  # a parameter shared by two modules (tied embeddings) once, as named_parameters() does
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                parameters.append((dot + name, parameter))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                buffers.append((dot + name, buffer))
    return [*parameters, *buffers]


def _signature(model: torch.nn.Module) -> tuple:
    """What invalidates a cached digest: every module holding tensors (its identity), then each of its parameters'
    and persistent buffers' identity, storage address, shape, dtype and in-place version counter. So a tensor added,
    removed, replaced, moved between modules or written in place changes it. This check runs per request: one walk
    of ``_modules`` in breadth-first order (a shared module visited once), ~0.3 ms for the 339 tensors of a 28-layer
    model on this project's CPU, where :func:`_tensors` (names built) took ~1.1 ms.

    Inference tensors (created under ``torch.inference_mode``, e.g. buffers a quantized layer packs on its first
    forward) have no version counter: for them only the address counts, so an in-place change to one inside
    inference mode is not noticed (call :func:`forget_model_digest` after such a change)."""
    modules, seen = [model], {id(model)}
    signature: list[object] = []
    for module in modules:
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                modules.append(child)
        parameters, buffers = module._parameters, module._buffers
        if not parameters and not buffers:
            continue
        signature.append(id(module))
        skipped = module._non_persistent_buffers_set
        for name, t in (*parameters.items(), *buffers.items()):
            if t is not None and name not in skipped:
                signature.append((id(t), t.data_ptr(), t.shape, t.dtype, -1 if t.is_inference() else t._version))
    return tuple(signature)


def _weight_digest(model: torch.nn.Module) -> str:
    signature = _signature(model)
    cached = _weight_digests.get(model)
    if cached is not None and cached[0] == signature:
        return cached[1]
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, tensor in _tensors(model):
            if tensor.device.type == "meta":
                raise InputError(
                    f"weight {name} is on the meta device (offloaded), so it cannot be fingerprinted: pass model_id"
                )
            h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\0".encode())
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to("cpu")
            h.update(raw.numpy().data)
    digest = h.hexdigest()
    _weight_digests[model] = (signature, digest)
    return digest


def _adapter_state(model: torch.nn.Module) -> dict[str, object]:
    """Active PEFT adapters and their configs (PEFT models and transformers' adapter integration); {} if none."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return {}
    active = getattr(model, "active_adapters", None)
    if callable(active):
        active = active()
    if isinstance(active, str):
        active = [active]
    return {
        "active": sorted(active or ()),
        "configs": {name: getattr(cfg, "to_dict", lambda c=cfg: repr(c))() for name, cfg in configs.items()},
    }


def forget_model_digest(model: torch.nn.Module) -> None:
    """Drop the cached weight digest (after weights were written in a way the version counters miss, such as
    through ``param.data``; see :func:`model_digest`)."""
    _weight_digests.pop(model, None)


@dataclass(frozen=True)
class KeySpace:
    """What names a chunk besides its tokens: the model's digest, the K/V dtype, the chunking and the stored
    precision (``kv_cache_bits``; ``kv_group_size`` counts below 16 bits only). Picklable and model-free: the cache,
    the batch policy and the Ray router all take their namespaces from one, so a router process computes the store's
    keys without the model."""

    digest: str
    dtype: str
    chunking: ChunkingConfig
    kv_cache_bits: int = FULL_PRECISION_BITS
    kv_group_size: int | None = None

    @classmethod
    def of_model(
        cls,
        model: torch.nn.Module,
        dtype: torch.dtype,
        chunking: ChunkingConfig,
        *,
        kv_cache_bits: int = FULL_PRECISION_BITS,
        kv_group_size: int | None = None,
        model_id: str | None = None,
    ) -> KeySpace:
        """The key space of ``model`` computing K/V in ``dtype`` (``model_id``: see :func:`model_digest`; reads every
        weight once to digest it, then reuses the digest while the weights are unchanged)."""
        return cls(model_digest(model, model_id), str(dtype), chunking, kv_cache_bits, kv_group_size)

    def namespace(self, cache_salt: str | None = None) -> str:
        """The namespace key (hex) of tenant ``cache_salt``: caches with different salts never see each other's
        chunks."""
        return namespace_key(
            self.digest,
            self.dtype,
            self.chunking,
            kv_cache_bits=self.kv_cache_bits,
            kv_group_size=self.kv_group_size,
            cache_salt=cache_salt,
        )


def make_namespace(
    model: torch.nn.Module,
    dtype: torch.dtype,
    chunking: ChunkingConfig,
    *,
    kv_cache_bits: int = FULL_PRECISION_BITS,
    kv_group_size: int | None = None,
    cache_salt: str | None = None,
    model_id: str | None = None,
) -> str:
    """``KeySpace.of_model(...).namespace(cache_salt)``: the namespace of one model + settings + stored precision +
    tenant."""
    space = KeySpace.of_model(
        model, dtype, chunking, kv_cache_bits=kv_cache_bits, kv_group_size=kv_group_size, model_id=model_id
    )
    return space.namespace(cache_salt)


def namespace_key(
    digest: str,
    dtype: str,
    chunking: ChunkingConfig,
    *,
    kv_cache_bits: int = FULL_PRECISION_BITS,
    kv_group_size: int | None = None,
    cache_salt: str | None = None,
) -> str:
    """The namespace key of :meth:`KeySpace.namespace` from its fields."""
    payload = {
        "format": STORAGE_FORMAT_VERSION,
        "model": digest,
        "dtype": dtype,
        "chunking": chunking.fingerprint(),
        "kv_cache_bits": kv_cache_bits,
        "salt": cache_salt,
    }
    if kv_cache_bits < FULL_PRECISION_BITS:
        payload["kv_group_size"] = kv_group_size
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int64).tobytes()


def prefix_key(namespace: str, parent_key: str | None, token_ids: Sequence[int]) -> str:
    """Key of a chunk computed after exactly the chunks chained through ``parent_key`` (None for the first)."""
    h = hashlib.sha256(b"prefix\0" + namespace.encode() + b"\0" + (parent_key or "").encode() + b"\0")
    h.update(_token_bytes(token_ids))
    return h.hexdigest()


def content_key(namespace: str, token_ids: Sequence[int]) -> str:
    """Key of a chunk's text alone, independent of what precedes it."""
    h = hashlib.sha256(b"content\0" + namespace.encode() + b"\0")
    h.update(_token_bytes(token_ids))
    return h.hexdigest()


def chain_prefix_keys(
    namespace: str, token_ids: Sequence[int], spans: Sequence[Span], parent_key: str | None = None
) -> list[str]:
    """Prefix keys of consecutive ``spans`` of ``token_ids``, chained from ``parent_key``."""
    keys: list[str] = []
    for start, end in spans:
        parent_key = prefix_key(namespace, parent_key, token_ids[start:end])
        keys.append(parent_key)
    return keys
