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

import hashlib
import json
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvboost_hf.core.chunking import ChunkingConfig, Span

STORAGE_FORMAT_VERSION = 1
_WEIGHT_SAMPLES_PER_TENSOR = 4096
_IGNORED_CONFIG_FIELDS = ("_name_or_path", "transformers_version", "_attn_implementation", "architectures")

_model_digests: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def model_digest(model: torch.nn.Module) -> str:
    """Identity of a model: its config (minus paths and versions) and a sampled digest of every weight.

    Each parameter and buffer contributes its name, shape, dtype, sum and up to 4096 evenly strided values, so
    two checkpoints of one architecture (or a fine-tune) get different digests without hashing every byte.
    Cached per model object; call :func:`forget_model_digest` after changing weights in place.
    """
    cached = _model_digests.get(model)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        fields = {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG_FIELDS}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // _WEIGHT_SAMPLES_PER_TENSOR)
            sample = flat[::step][:_WEIGHT_SAMPLES_PER_TENSOR].to("cpu", torch.float64)
            h.update(
                f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{float(flat.sum(dtype=torch.float64)):.10e}".encode()
            )
            h.update(sample.numpy().tobytes())
    digest = h.hexdigest()
    _model_digests[model] = digest
    return digest


def forget_model_digest(model: torch.nn.Module) -> None:
    """Drop the cached digest (after the weights were changed in place)."""
    _model_digests.pop(model, None)


def make_namespace(
    model: torch.nn.Module,
    dtype: torch.dtype,
    chunking: ChunkingConfig,
    *,
    kv_cache_bits: int = 16,
    kv_group_size: int | None = None,
    cache_salt: str | None = None,
) -> str:
    """Namespace key (hex) for one model + settings + stored precision + tenant.

    ``kv_cache_bits`` and ``kv_group_size`` are the store's (the precision K/V come back in); the group size only
    matters, and only enters the key, below 16 bits.
    """
    payload = {
        "format": STORAGE_FORMAT_VERSION,
        "model": model_digest(model),
        "dtype": str(dtype),
        "chunking": chunking.fingerprint(),
        "kv_cache_bits": kv_cache_bits,
        "salt": cache_salt,
    }
    if kv_cache_bits < 16:
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
