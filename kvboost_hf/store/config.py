"""Settings of a :class:`~kvboost_hf.store.chunk_store.ChunkStore` and the tiers they build."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvboost_hf.store.base import StorageTier
from kvboost_hf.store.disk import DEFAULT_MAX_BYTES as DEFAULT_DISK_MAX_BYTES
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.quantization import DEFAULT_GROUP_SIZE, SUPPORTED_BITS
from kvboost_hf.store.remote import DEFAULT_PREFIX, RemoteTier


@dataclass(frozen=True)
class StoreConfig:
    """Settings of a chunk store; validated on creation (ValueError naming the field).

    Attributes:
        max_bytes: RAM budget in bytes (of the stored form: quantized bytes with ``kv_cache_bits`` < 16).
        kv_cache_bits: 16 keeps K/V as computed; 8 or 4 stores KIVI-quantized K/V in every tier.
        kv_group_size: quantization group, in tokens (keys) and channels (values).
        disk_cache_dir: enables the disk tier in that directory (shared safely by several processes).
        disk_max_bytes: bytes of records the disk tier may hold (the file grows as needed, never reserved).
        remote_url: enables the Redis tier (``redis://``, ``rediss://``, ``redis+cluster://``; credentials in
            the URL).
        remote_prefix: prefix of every Redis key the store reads and writes.
        remote_ttl_s: expiry of every Redis key written, in seconds (None: Redis's eviction only).
        remote_read_timeout_s: longest a Redis lookup (connect included) may wait, in seconds, before it is a miss.
        remote_hmac_key: secret sealing Redis records with HMAC-SHA256; records without a valid seal are refused.
        device: where RAM entries live and where ``get`` returns them (``"cpu"``, ``"cuda:0"``...).
    """

    max_bytes: int = 2 << 30
    kv_cache_bits: int = 16
    kv_group_size: int = DEFAULT_GROUP_SIZE
    disk_cache_dir: str | os.PathLike[str] | None = None
    disk_max_bytes: int = DEFAULT_DISK_MAX_BYTES
    remote_url: str | None = None
    remote_prefix: str = DEFAULT_PREFIX
    remote_ttl_s: float | None = None
    remote_read_timeout_s: float = 0.25
    remote_hmac_key: bytes | str | None = None
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        if self.kv_cache_bits != 16 and self.kv_cache_bits not in SUPPORTED_BITS:
            raise ValueError(f"kv_cache_bits must be 16, 8 or 4, got {self.kv_cache_bits}")
        if self.kv_group_size < 1:
            raise ValueError(f"kv_group_size must be >= 1 (tokens or channels), got {self.kv_group_size}")

    def build_tiers(self) -> list[StorageTier]:
        """The tiers below RAM that these settings enable, fastest first: disk, then Redis."""
        tiers: list[StorageTier] = []
        if self.disk_cache_dir is not None:
            tiers.append(DiskTier(self.disk_cache_dir, self.disk_max_bytes))
        if self.remote_url:
            tiers.append(
                RemoteTier(
                    self.remote_url,
                    prefix=self.remote_prefix,
                    ttl_s=self.remote_ttl_s,
                    read_timeout_s=self.remote_read_timeout_s,
                    hmac_key=self.remote_hmac_key,
                )
            )
        return tiers
