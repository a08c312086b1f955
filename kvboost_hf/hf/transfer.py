"""Host values onto the device without making the host wait on it.

``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``: the host then waits for every operation
queued on the stream before the copy (a synchronisation in the middle of a step). :func:`to_device` copies the same
values asynchronously, so a step's host work goes on while the device still runs the work before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], device: torch.device) -> torch.Tensor:
    """``values`` (ints, nested lists) as a long tensor on ``device``, copied without a host synchronisation."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
