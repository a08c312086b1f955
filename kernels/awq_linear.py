"""``AwqInt4Linear``: an AWQ int4 linear layer whose GPU path is the Triton kernel of :mod:`.awq_int4` (no compiled
extension), and :func:`replace_awq_linears`, which swaps it in for the AWQ layers of a loaded model.

The layer holds only the packed tensors, as buffers named like the checkpoint's (``qweight``, ``qzeros``,
``scales``, ``bias``): its ``state_dict`` loads from an AWQ GEMM checkpoint as is, and a layer streamer copies the
packed bytes (never a dequantized weight: a forward creates no tensor attribute).

Where it computes: the Triton kernel on CUDA, or on any device under ``TRITON_INTERPRET=1`` (the CPU tests);
otherwise (CPU, or no Triton) the plain-torch reference (dequantize, then matmul in the activations' dtype).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from kvboost_hf.core.errors import InputError
from kvboost_hf.kernels.awq_reference import PACK, awq_reference_matmul, check_group_size

logger = logging.getLogger(__name__)

_AWQ_TENSORS = ("qweight", "qzeros", "scales")


def triton_runs_on(device: torch.device) -> bool:
    """True when the Triton kernel serves tensors on ``device``: CUDA, or the interpreter (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _kernel() -> Callable[..., torch.Tensor]:
    """The Triton launcher, imported on first use (so TRITON_INTERPRET set before it decides how it runs)."""
    from kvboost_hf.kernels.awq_int4 import awq_int4_matmul

    return awq_int4_matmul


class AwqInt4Linear(torch.nn.Module):
    """``y = x @ W + bias`` with ``W`` ``[in_features, out_features]`` stored as AWQ GEMM int4 (see
    :mod:`.awq_reference`). ``out_features`` must be a multiple of 8 and ``in_features`` of ``group_size``.

    The result has the activations' dtype (float16, bfloat16 or float32); ``scales`` and ``bias`` keep theirs.
    """

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        scales_dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__()
        check_group_size(group_size)
        if out_features % PACK or in_features % group_size:
            raise InputError(
                f"AWQ int4 needs out_features ({out_features}) divisible by {PACK} and in_features ({in_features}) "
                f"divisible by group_size ({group_size})"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.zeros(in_features, out_features // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer("qzeros", torch.zeros(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=scales_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=scales_dtype, device=device) if bias else None)

    @classmethod
    def from_packed(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> AwqInt4Linear:
        """A layer holding these tensors (not copies); shapes are checked against ``group_size``."""
        in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
        layer = cls(in_features, out_features, group_size, device="meta", scales_dtype=scales.dtype)
        expected = {
            "qweight": (in_features, out_features // PACK),
            "qzeros": (in_features // group_size, out_features // PACK),
            "scales": (in_features // group_size, out_features),
        }
        for name, tensor in zip(_AWQ_TENSORS, (qweight, qzeros, scales), strict=True):
            if tuple(tensor.shape) != expected[name]:
                raise InputError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
            layer._buffers[name] = tensor
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise InputError(f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        layer._buffers["bias"] = bias
        return layer

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight, zeros, scales and bias (what a streamed forward copies for this layer)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values() if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if triton_runs_on(x.device):
            out = _kernel()(rows, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)
        else:
            out = awq_reference_matmul(rows, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}"
        )


def _is_awq_layer(module: torch.nn.Module) -> bool:
    return not isinstance(module, AwqInt4Linear) and all(
        isinstance(getattr(module, name, None), torch.Tensor) for name in _AWQ_TENSORS
    )


def replace_awq_linears(model: torch.nn.Module, group_size: int | None = None) -> int:
    """Replace, in place, every AWQ GEMM linear of ``model`` (a module holding ``qweight``, ``qzeros`` and
    ``scales`` tensors, e.g. gptqmodel's AWQ layers, before their first forward repacks them) by an
    :class:`AwqInt4Linear` sharing its tensors; returns how many. ``group_size``: default the layer's own
    ``group_size`` attribute, else the one the tensors' shapes imply."""
    targets = [(name, module) for name, module in model.named_modules() if _is_awq_layer(module)]
    for name, module in targets:
        qweight = module.qweight
        size = group_size or getattr(module, "group_size", None) or qweight.shape[0] // module.qzeros.shape[0]
        bias = getattr(module, "bias", None)
        replacement = AwqInt4Linear.from_packed(qweight, module.qzeros, module.scales, int(size), bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    logger.info("Replaced %d AWQ linear layers by AwqInt4Linear", len(targets))
    return len(targets)
