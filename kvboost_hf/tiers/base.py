"""Types shared by the store and its tiers: :class:`ChunkKV`, the stored form of an entry, the tier interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypeAlias

import torch

from kvboost_hf.quantization import QuantizedChunk


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


StoredChunk: TypeAlias = ChunkKV | QuantizedChunk
"""What tiers hold: the K/V as computed (``kv_cache_bits=16``) or KIVI-quantized (8 or 4 bits)."""


class StorageTier(ABC):
    """One level of the store. Implementations are thread-safe and never exceed their byte budget.

    Tiers hold :data:`StoredChunk` values and never convert between forms; the store quantizes on ``put`` and
    dequantises on ``get``.
    """

    name: str

    @abstractmethod
    def get(self, key: str) -> StoredChunk | None:
        """The entry under ``key``, or None. Never returns an entry whose bytes fail verification."""

    @abstractmethod
    def put(self, key: str, entry: StoredChunk) -> list[tuple[str, StoredChunk]]:
        """Store ``entry``; return the entries evicted to make room (for demotion to a lower tier)."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes currently held."""

    @abstractmethod
    def __len__(self) -> int: ...
