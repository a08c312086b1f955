"""Settings of layer streaming: which decoder layers stay on the device and how many device slots stream the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_hf.core.errors import ConfigError


@dataclass(frozen=True)
class LayerStreamingConfig:
    """How a model larger than the device runs: some decoder layers stream from host memory on every forward.

    Args:
        keep_first_k, keep_last_k: decoder layers at each end that stay resident on the device (embeddings, the
            final norm and ``lm_head`` always do).
        num_slots: device buffers, each as large as the largest streamed layer, that streamed layers are copied
            into in turn. 2 = double buffering (layer i+1 is copied while layer i computes); 3 gives the copy
            more slack; 1 disables prefetch (every copy is waited for in full).
        pin_memory: keep the host copies in page-locked memory (needed for asynchronous copies on CUDA;
            ignored on CPU, where there is no pinned allocator).
        device_memory_budget_bytes: optional budget for the model's tensors on the device (resident parts plus
            the slots; K/V and activations are not counted, leave room for them). When set, layers after the
            first ``keep_first_k`` are made resident as long as the budget allows.
        device: where the model computes (default: CUDA when available, else CPU; on CPU the same code runs with
            synchronous copies, which is how correctness is tested without a GPU).
    """

    keep_first_k: int = 0
    keep_last_k: int = 0
    num_slots: int = 2
    pin_memory: bool = True
    device_memory_budget_bytes: int | None = None
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        for name in ("keep_first_k", "keep_last_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"LayerStreamingConfig.{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.num_slots, int) or isinstance(self.num_slots, bool) or self.num_slots < 1:
            raise ConfigError(f"LayerStreamingConfig.num_slots must be an integer >= 1, got {self.num_slots!r}")
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"LayerStreamingConfig.pin_memory must be a bool, got {self.pin_memory!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"LayerStreamingConfig.device is not a torch device: {self.device!r}") from exc
        budget = self.device_memory_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ConfigError(
                f"LayerStreamingConfig.device_memory_budget_bytes must be a positive integer, got {budget!r}"
            )

    @property
    def target_device(self) -> torch.device:
        """The compute device (resolved default)."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


LayerStreaming = LayerStreamingConfig  # the name of earlier versions, still in README examples
