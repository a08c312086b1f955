"""The unit of reuse: :class:`ChunkKV`, the K/V of one chunk for every layer of a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_hf.core.errors import InputError


@dataclass(frozen=True)
class ChunkKV:
    """K/V of one chunk for every layer of a model.

    ``keys`` and ``values`` are ``[num_layers, num_kv_heads, num_tokens, head_dim]`` (keys already RoPE-rotated
    at the chunk's positions). Entries are immutable once stored: readers may share the tensors.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.values.dim() != 4 or self.keys.shape[:3] != self.values.shape[:3]:
            raise InputError(
                "ChunkKV needs keys and values shaped [num_layers, num_kv_heads, num_tokens, head_dim], got "
                f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def to(self, device: torch.device, non_blocking: bool = False) -> ChunkKV:
        keys = self.keys.to(device, non_blocking=non_blocking)
        return ChunkKV(keys, self.values.to(device, non_blocking=non_blocking))

    def pinned(self) -> ChunkKV:
        """This entry in page-locked host memory (itself when it is there already): copies from it to a GPU run
        asynchronously at full bandwidth. Pinned blocks come from torch's caching host allocator (pooled)."""
        return ChunkKV(pinned_copy(self.keys), pinned_copy(self.values))


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked host memory (``tensor`` itself when it is pinned already)."""
    if tensor.device.type == "cpu" and tensor.is_pinned():
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor)
    return out
