"""The unit of reuse: :class:`ChunkKV`, the K/V of one chunk for every layer of a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
            raise ValueError(
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

    def to(self, device: torch.device) -> ChunkKV:
        return ChunkKV(self.keys.to(device), self.values.to(device))
