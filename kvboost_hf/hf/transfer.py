"""Values between host and device without making the host wait on more than it needs.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``: the host then waits for every operation
queued on the stream before the copy (a synchronisation in the middle of a step). :func:`to_device` copies the same
values asynchronously, so a step's host work goes on while the device still runs the work before it.
:func:`to_host_later` starts a device tensor's copy to the host now and reads it later: work queued on the stream
after the copy (the next decode step) does not delay the read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], device: torch.device) -> torch.Tensor:
    """``values`` (ints, nested lists) as a long tensor on ``device``, copied without a host synchronisation."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def to_host_later(tensor: torch.Tensor) -> Callable[[], list[Any]]:
    """A function returning ``tensor.tolist()``, whose copy to the host starts now. On CUDA: a non-blocking copy
    into page-locked memory with an event after it, so the read waits for that event only, not for what the
    stream runs after the copy; elsewhere the read copies then."""
    if tensor.device.type != "cuda":
        return tensor.tolist
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list[Any]:
        copied.synchronize()
        return host.tolist()

    return read
