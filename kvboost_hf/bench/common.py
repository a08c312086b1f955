"""Shared plumbing of the benchmark scripts: machine description, argument parsing, saving results."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """Where a figure was measured: it only compares with figures from the same machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def first_difference(first: Sequence[int], second: Sequence[int]) -> int | None:
    """Index of the first generated token where two greedy outputs differ (the shorter one's length when it is a
    prefix of the other), None when they are identical."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return None if len(first) == len(second) else min(len(first), len(second))


def earliest_difference(indices: Sequence[int | None]) -> int | None:
    """The earliest of several :func:`first_difference` results (None when every pair was identical)."""
    found = [index for index in indices if index is not None]
    return min(found) if found else None


def agreement_label(index: int | None) -> str:
    """``=`` for identical outputs, ``@k`` for outputs that first differ at generated token ``k``."""
    return "=" if index is None else f"@{index}"


def parser_for(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser for ``python -m kvboost_hf.bench NAME`` with the common ``--out`` option."""
    parser = argparse.ArgumentParser(
        prog=f"python -m kvboost_hf.bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON and PNG")
    return parser


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (benchmarks write PNG files; no display needed),
    unless a backend is chosen already (``pyplot`` imported, or ``MPLBACKEND`` set, as a Jupyter kernel sets its
    inline backend): a benchmark's plot drawn in a notebook must not turn the notebook's own figures off."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules and "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_results(
    out: Path, name: str, result: dict[str, Any], report: Callable[[dict], str], plot: Callable[[dict, Path], None]
) -> None:
    """Write ``NAME.json`` and ``NAME.png`` under ``out`` and print the report table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")
    print(report(result))
    print(f"saved {out / f'{name}.json'} and {out / f'{name}.png'}")


class FirstTokenTimer(BaseStreamer):
    """A ``generate(streamer=...)`` that notes when the first generated token exists (``first_token_time``, a
    ``time.perf_counter()`` value; None before it). ``generate()`` puts the prompt first, then each step's tokens;
    moving them to the CPU synchronises the device, so the time is when the token really exists."""

    def __init__(self) -> None:
        self.first_token_time: float | None = None
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen and self.first_token_time is None:
            value.cpu()
            self.first_token_time = time.perf_counter()
        self._prompt_seen = True

    def end(self) -> None:
        return None
