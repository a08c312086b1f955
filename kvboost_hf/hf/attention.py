"""``attn_implementation="kvboost"``: the Triton flash-attention kernel behind transformers' attention interfaces.

Mask contract between :func:`kvboost_mask` (registered in ``AttentionMaskInterface``) and
:func:`kvboost_attention_forward` (registered in ``AttentionInterface``):

* ``None`` means plain causal attention where the queries are the *last* ``Lq`` of the ``Lk`` keys (bottom-right
  alignment): plain prefill, prefill on top of a cache, decode. The kernel masks by absolute key index, so no mask
  is materialised. This is a superset of the cases in which sdpa's own mask function returns ``None``.
* otherwise a 4D mask ``[B, 1|H, Lq, >=Lk]``, boolean (True = attend) or additive float (0 / ``-inf``): sdpa's
  mask for padding, sliding windows, static caches, packed sequences, or a caller's explicit 4D mask (e.g. the
  repair forward over scattered query positions). The kernel loads it tile by tile and applies nothing else.

A packed forward (:data:`~kvboost_hf.hf.packed.PACKED_KWARG`: several batches' new tokens in one row, each part
attending to its own cache) is computed by :meth:`~kvboost_hf.hf.packed.PackedCaches.attention`.

A forward that passes :data:`~kvboost_hf.hf.context_attention.ADJUSTMENT_KWARG` (the reuse cache does, for a
repair config with an APE-style context temperature or scale) is computed by
:func:`~kvboost_hf.hf.context_attention.adjusted_attention` instead, on any device.

Unmasked plain causal prefill (``Lq == Lk``) and single-query calls go to torch's SDPA, whose default backend is
faster there and needs no mask (:data:`ROUTE_PLAIN_TO_SDPA`); the kernel serves queries over a longer cache (a
prompt on top of reused chunks: SDPA would need a materialised mask and expanded K/V for those) and explicit
masks. On the CPU (:data:`ROUTE_CPU_TO_SDPA`) those calls go to torch's SDPA with ``enable_gqa``: its CPU
kernel reads grouped K/V in place, where transformers' sdpa path copies every layer's K/V ``heads / kv_heads``
times whenever a mask is given (a 16-token prompt chunk over 4k tokens of context: ~16% of its forward on the
embedded model). Where neither can run (no Triton on CUDA, training, unsupported dtype/head dim/features) the call
goes to transformers' sdpa implementation, with one log line per reason.

The function is traceable by ``torch.compile(fullgraph=True)`` (the graphed decode steps and short prefills of
:mod:`kvboost_hf.hf.graphs`) with the routing of its eager calls: every host-side decision it takes reads the
tensors' shapes, devices and dtypes, module flags, or a constant resolved outside tracing (Triton's presence at
import, ``TRITON_INTERPRET`` at trace time); fallbacks are logged by eager calls only. The kernel is the custom op
``torch.ops.kvboost.flash_attention`` (:func:`flash_attention_op`), opaque to the compiler: inductor calls it and a
CUDA graph captures its launches.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from kvboost_hf.core.errors import InputError, StateError, UnsupportedModelError
from kvboost_hf.hf.context_attention import ADJUSTMENT_KWARG, adjusted_attention

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvboost"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_MAX_HEAD_DIM = 128
_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "cache")
_EAGER_ONLY_KWARGS = ("softcap", "s_aux", "sinks")  # features torch SDPA lacks: the model's eager attention runs
PACKED_KWARG = "kvboost_packed"
"""The forward keyword that carries a packed forward's caches (a :class:`~kvboost_hf.hf.packed.PackedCaches`) down to
the attention function, which hands the call to its ``attention(layer_idx, query, scaling)``."""
ROUTE_PLAIN_TO_SDPA = True
"""Send unmasked calls with ``Lq == Lk`` (plain causal prefill) or ``Lq == 1`` (decode without padding) to torch's
SDPA, which needs no mask for them; False sends every supported call to the Triton kernel (the kernel's tests)."""
ROUTE_CPU_TO_SDPA = True
"""Send the calls on CPU tensors that the kernel would serve to torch's SDPA reading grouped K/V in place
(:func:`_grouped_sdpa`); False runs the kernel on them interpreted, when ``TRITON_INTERPRET=1`` is set (the
kernel's tests: the test session sets that variable for Triton, so it cannot be what picks the route)."""


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
"""Whether Triton can be imported, looked up once here without importing it (so ``TRITON_INTERPRET`` can still be
set before the kernel module loads): a constant that compiled graphs read instead of calling ``find_spec``."""


@torch.compiler.assume_constant_result
def _interpret_mode() -> bool:
    """``TRITON_INTERPRET=1``: read per eager call; a compiled graph reads it once when traced and keeps the value
    (Triton itself fixes interpretation when its kernels are first decorated, so it cannot change usefully later)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_attn_implementation(device: torch.device) -> str | None:
    """The ``attn_implementation`` the package loads a model with to run on ``device``: ``"kvboost"`` on the CPU
    (grouped K/V read in place for masked queries, see the module doc), None (transformers' default) elsewhere."""
    return ATTN_IMPLEMENTATION if device.type == "cpu" else None


@functools.cache
def _kernel() -> Callable[..., torch.Tensor]:
    """The Triton launcher, imported on first launch (so TRITON_INTERPRET can still be set before it). Called only
    by the custom op's implementation (:func:`flash_attention_op`), which runs eagerly, never under tracing; the
    caller has checked :data:`_TRITON_INSTALLED`."""
    from kvboost_hf.kernels.flash_attention import flash_attention

    return flash_attention


@torch.library.custom_op("kvboost::flash_attention", mutates_args=())
def flash_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    causal: bool,
) -> torch.Tensor:
    """``torch.ops.kvboost.flash_attention``: the Triton kernel (:func:`kvboost_hf.kernels.flash_attention.
    flash_attention`) as an op the compiler treats as opaque. q ``[B, H, Lq, D]``, k/v ``[B, H_kv, Lk, D]``,
    ``mask`` None (causal bottom-right when ``causal``) or 4D -> a new contiguous ``[B, Lq, H, D]`` tensor in
    ``query``'s dtype, on its device; the inputs are only read."""
    return _kernel()(query, key, value, scale=scale, causal=causal, mask=mask)


@flash_attention_op.register_fake
def _flash_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    causal: bool,
) -> torch.Tensor:
    """The op's output under tracing: shape, dtype, device and (contiguous) strides of the launcher's ``out``."""
    batch, heads, num_q, head_dim = query.shape
    return query.new_empty(batch, num_q, heads, head_dim)


@functools.cache
def _log_fallback(reason: str, target: str = "torch SDPA") -> None:
    logger.warning("kvboost attention falls back to %s: %s", target, reason)


def _warn_fallback(reason: str, target: str = "torch SDPA") -> None:
    """Log a fallback once per (reason, target), from eager calls: under tracing (dynamo cannot trace the logging
    or the cache around it) nothing is logged; the same call run eagerly logs it."""
    if not torch.compiler.is_compiling():
        _log_fallback(reason, target)


def _unsupported_reason(query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]) -> str | None:
    """Why neither the Triton kernel nor :func:`_grouped_sdpa` can serve this call (training, a feature neither
    implements), or None."""
    if dropout > 0.0 or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
        return "the kernel is forward-only (dropout or autograd requested)"
    used = [name for name in _UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if used:
        return f"unsupported arguments {used}"
    return None


def _kernel_unavailable_reason(query: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot run on these tensors (device, Triton, dtype, head dim), or None when it can."""
    if query.device.type != "cuda" and not _interpret_mode():
        return f"tensors are on {query.device.type} (set TRITON_INTERPRET=1 to run the kernel interpreted)"
    if not _TRITON_INSTALLED:
        return "triton is not installed"
    if query.dtype not in _KERNEL_DTYPES:
        return f"dtype {query.dtype} is not supported"
    if query.shape[-1] > _KERNEL_MAX_HEAD_DIM or value.shape[-1] != query.shape[-1]:
        return f"head dims q={query.shape[-1]} v={value.shape[-1]} are not supported"
    return None


def bottom_right_causal_mask(num_q: int, num_k: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[1, 1, Lq, Lk]``: query ``i`` sees keys ``j <= Lk - Lq + i``."""
    return torch.ones(num_q, num_k, dtype=torch.bool, device=device).tril(num_k - num_q)[None, None]


def _grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    causal: bool,
) -> torch.Tensor:
    """torch SDPA over grouped K/V read in place (``enable_gqa``): q ``[B, H, Lq, D]``, k/v ``[B, H_kv, Lk, D]``,
    ``mask`` None (then causal, bottom-right aligned, when ``causal``) or 4D -> ``[B, Lq, H, D]``."""
    num_q, num_k = query.shape[2], key.shape[2]
    if mask is None and causal and num_q > 1:
        mask = bottom_right_causal_mask(num_q, num_k, query.device)
    elif mask is not None:
        mask = mask[..., :num_k]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous()


def kvboost_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers: q ``[B, H, Lq, D]``, k/v ``[B, H_kv, Lk, D]`` -> (``[B, Lq, H, D]``, None)."""
    if (packed := kwargs.pop(PACKED_KWARG, None)) is not None:  # one forward of several batches' tokens
        if (reason := _unsupported_reason(query, key, dropout, kwargs)) is not None:
            raise StateError(f"a packed forward cannot serve this attention call: {reason}")
        return packed.attention(module.layer_idx, query, scaling), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    num_q, num_k = query.shape[2], key.shape[2]
    adjustment = kwargs.pop(ADJUSTMENT_KWARG, None)
    if adjustment is not None:
        if attention_mask is None and not causal:
            attention_mask = torch.ones(1, 1, num_q, num_k, dtype=torch.bool, device=query.device)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise InputError("the context adjustment needs the queries' position_ids")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return adjusted_attention(query, key, value, attention_mask, scale, adjustment, position_ids), None
    if any(kwargs.get(name) is not None for name in _EAGER_ONLY_KWARGS):
        used = [name for name in _EAGER_ONLY_KWARGS if kwargs.get(name) is not None]
        _warn_fallback(f"{used} are not implemented by SDPA", target="the model's eager attention")
        return _eager_attention(module, query, key, value, attention_mask, causal, dropout, scaling, kwargs)
    if attention_mask is None and (num_q == num_k or num_q == 1) and ROUTE_PLAIN_TO_SDPA:
        # plain causal prefill, or one query seeing every key: torch's default SDPA needs no mask there and runs
        # a fused GQA kernel (1.5x the Triton kernel's prefill on an H200); the kernel serves the shapes only it
        # handles without a materialised mask (queries over a longer cache, explicit masks)
        return sdpa_attention_forward(
            module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
        )
    reason = _unsupported_reason(query, key, dropout, kwargs)
    if reason is None and query.device.type == "cpu" and (ROUTE_CPU_TO_SDPA or not _interpret_mode()):
        return _grouped_sdpa(query, key, value, attention_mask, scaling, causal), None
    reason = reason or _kernel_unavailable_reason(query, value)
    if reason is not None:
        _warn_fallback(reason)
        if attention_mask is None and causal and 1 < num_q < num_k:
            attention_mask = bottom_right_causal_mask(num_q, num_k, query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs
        )
    mask = attention_mask[..., :num_k] if attention_mask is not None else None
    return flash_attention_op(query, key, value, mask, scaling, causal and mask is None), None


def _eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """The attention module's own ``eager_attention_forward`` (from its modeling module: the one that implements
    its softcapping or sinks), given the additive mask it expects: ``"kvboost"``'s mask is None for a bottom-right
    causal call and boolean otherwise. A model module without one is refused by name."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {[n for n in _EAGER_ONLY_KWARGS if kwargs.get(n) is not None]} to "
            f"attention, which only its eager attention implements; load the model without "
            f"attn_implementation={ATTN_IMPLEMENTATION!r}"
        )
    num_q, num_k = query.shape[2], key.shape[2]
    if attention_mask is None and causal and num_q > 1:
        attention_mask = bottom_right_causal_mask(num_q, num_k, query.device)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, blocked)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _is_bottom_right_causal(
    q_length: int, kv_length: int, q_offset: Any, kv_offset: Any, mask_function: Callable, padding: Any
) -> bool:
    """True when the mask is exactly causal with the queries being the last keys and no padding inside the window.

    Decided from Python ints only (the offsets: a static cache's tensor offset is never bottom-right causal here) and,
    in eager calls, the padding's values; under tracing, where reading those would break the graph, any padding
    counts as not causal, so a traced forward without a padding mask gets the eager forward's None mask."""
    if mask_function is not causal_mask_function:
        return False
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int)) or q_offset + q_length != kv_offset + kv_length:
        return False
    if padding is None:
        return True
    return not torch.compiler.is_compiling() and bool(padding[:, kv_offset : kv_offset + kv_length].all())


def kvboost_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """sdpa's boolean mask, or None whenever the kernel's bottom-right causal masking is exact (see module doc)."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and _is_bottom_right_causal(
        q_length, kv_length, q_offset, kv_offset, mask_function, padding
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def register_kvboost_attention() -> None:
    """Register ``"kvboost"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvboost_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvboost_mask)


register_kvboost_attention()  # importing this module registers (kvboost_hf's import arranges that it is imported)
