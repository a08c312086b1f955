"""Models larger than the device: decoder layers streamed from host memory (see :mod:`.streamer`)."""

from kvboost_hf.offload.budget import BudgetTooSmallError, DevicePlan, parse_bytes, plan_device_memory
from kvboost_hf.offload.settings import LayerStreamingConfig
from kvboost_hf.offload.streamer import (
    LayerStreamer,
    StreamingStats,
    decoder_layers,
    disable_layer_streaming,
    enable_layer_streaming,
    layer_device_bytes,
    layer_streamer,
)

__all__ = [
    "BudgetTooSmallError",
    "DevicePlan",
    "LayerStreamer",
    "LayerStreamingConfig",
    "StreamingStats",
    "decoder_layers",
    "disable_layer_streaming",
    "enable_layer_streaming",
    "layer_device_bytes",
    "layer_streamer",
    "parse_bytes",
    "plan_device_memory",
]
