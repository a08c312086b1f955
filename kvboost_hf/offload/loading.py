"""Loading a model for layer streaming: weights into host memory, only the resident parts onto the device."""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.hf.models import load_model_and_tokenizer
from kvboost_hf.offload.settings import LayerStreaming
from kvboost_hf.offload.streamer import LayerStreamer, enable_layer_streaming


def load_streamed_model(
    model_name_or_path: str | os.PathLike | None,
    streaming: LayerStreaming,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, LayerStreamer]:
    """Load on the CPU (no ``device_map``: no competing offload hooks), then stream the layers chosen by
    ``streaming`` to ``streaming.device`` (or ``device`` when that is unset). ``dtype`` defaults to bfloat16
    for a CUDA target, else float32; a quantized checkpoint keeps its packed weights."""
    if streaming.device is None and device is not None:
        streaming = dataclasses.replace(streaming, device=device)
    target = streaming.target_device
    if dtype is None:
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    model, tokenizer = load_model_and_tokenizer(model_name_or_path, device="cpu", dtype=dtype, strict=strict)
    return model, tokenizer, enable_layer_streaming(model, streaming)
