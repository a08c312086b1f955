"""Settings of a :class:`~kvboost_hf.store.chunk_store.ChunkStore` and the tiers they build."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.keys import FULL_PRECISION_BITS
from kvboost_hf.core.values import is_finite, is_integer
from kvboost_hf.store.base import StorageTier
from kvboost_hf.store.disk import DEFAULT_MAX_BYTES as DEFAULT_DISK_MAX_BYTES
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.quantization import DEFAULT_GROUP_SIZE, SUPPORTED_BITS
from kvboost_hf.store.remote import DEFAULT_PREFIX, DEFAULT_READ_TIMEOUT_S, RemoteTier, check_url


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
        pin_memory: keep CPU RAM entries in page-locked memory, so copies to a GPU run asynchronously at full
            bandwidth (~7x pageable on an H200). None: when CUDA is available.
        gpu_max_bytes: budget in bytes of a GPU tier in front of RAM, on ``gpu_device`` (hits promoted there,
            its evictions fall back to RAM). None: an engine whose model is on CUDA sizes it from the free memory
            after loading (:func:`default_gpu_tier_bytes`); 0: no GPU tier.
        gpu_device: the device of the GPU tier (None: the engine's model's device; the CPU is accepted, which runs
            the same tier policy without a GPU, as the tests do).
    """

    max_bytes: int = 2 << 30
    kv_cache_bits: int = FULL_PRECISION_BITS
    kv_group_size: int = DEFAULT_GROUP_SIZE
    disk_cache_dir: str | os.PathLike[str] | None = None
    disk_max_bytes: int = DEFAULT_DISK_MAX_BYTES
    remote_url: str | None = None
    remote_prefix: str = DEFAULT_PREFIX
    remote_ttl_s: float | None = None
    remote_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    remote_hmac_key: bytes | str | None = None
    device: torch.device | str = "cpu"
    pin_memory: bool | None = None
    gpu_max_bytes: int | None = None
    gpu_device: torch.device | str | None = None

    def __post_init__(self) -> None:
        for name, least in (("max_bytes", 0), ("disk_max_bytes", 1), ("kv_group_size", 1)):
            value = getattr(self, name)
            if not is_integer(value) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least} (bytes or tokens), got {value!r}")
        if self.gpu_max_bytes is not None and not (is_integer(self.gpu_max_bytes) and self.gpu_max_bytes >= 0):
            raise ConfigError(f"gpu_max_bytes must be an integer >= 0 (0: no GPU tier), got {self.gpu_max_bytes!r}")
        for name in ("remote_ttl_s", "remote_read_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (is_finite(value) and value > 0):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.remote_url is not None:
            check_url(self.remote_url)
        bits = self.kv_cache_bits  # an int: 8.0 == 8 passes a membership test but cannot shift codes
        if not (is_integer(bits) and (bits == FULL_PRECISION_BITS or bits in SUPPORTED_BITS)):
            raise ConfigError(f"kv_cache_bits must be 16, 8 or 4, got {self.kv_cache_bits!r}")

    @property
    def pins_memory(self) -> bool:
        """Whether CPU RAM entries are page-locked (``pin_memory``, resolved)."""
        on_cpu = torch.device(self.device).type == "cpu"
        return on_cpu and (torch.cuda.is_available() if self.pin_memory is None else self.pin_memory)

    def for_model_device(self, device: torch.device) -> StoreConfig:
        """These settings for a model on ``device``: on CUDA (with RAM entries on the CPU), the GPU tier is sized by
        :func:`default_gpu_tier_bytes` when ``gpu_max_bytes`` is None and placed on ``device`` when ``gpu_device``
        is None; ``gpu_max_bytes=0`` keeps it off."""
        if device.type != "cuda" or torch.device(self.device).type == "cuda" or self.gpu_max_bytes == 0:
            return self
        budget = default_gpu_tier_bytes(device) if self.gpu_max_bytes is None else self.gpu_max_bytes
        return dataclasses.replace(self, gpu_max_bytes=budget, gpu_device=self.gpu_device or device)

    @property
    def gpu_tier_device(self) -> torch.device | None:
        """Where the GPU tier lives: ``gpu_device``, else the current CUDA device when ``gpu_max_bytes`` is set;
        None without a GPU tier. Raises ValueError when ``gpu_max_bytes`` is set with no device to put it on."""
        if not self.gpu_max_bytes:
            return None
        if self.gpu_device is not None:
            return torch.device(self.gpu_device)
        if not torch.cuda.is_available():
            raise ConfigError(f"gpu_max_bytes={self.gpu_max_bytes} needs a gpu_device: no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())

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


GPU_TIER_FRACTION = 0.25
"""Share of the free GPU memory (after the model loaded) a default GPU tier takes."""
GPU_TIER_MAX_BYTES = 32 << 30
"""Cap of a default GPU tier, in bytes."""


def default_gpu_tier_bytes(device: torch.device) -> int:
    """Bytes of the default GPU tier on ``device``: ``GPU_TIER_FRACTION`` of its free memory now, at most
    ``GPU_TIER_MAX_BYTES`` (the rest stays for activations and the live caches of running requests)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(free * GPU_TIER_FRACTION, GPU_TIER_MAX_BYTES))
