"""Benchmark plots leave a matplotlib backend chosen before them alone (a notebook's inline figures keep showing)."""

from __future__ import annotations

import matplotlib

from kvboost_hf.bench.common import pyplot


def test_a_benchmark_plot_keeps_the_backend_a_kernel_or_a_user_chose(monkeypatch):
    chosen: list[str] = []
    monkeypatch.setattr(matplotlib, "use", chosen.append)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # as ipykernel sets it
    pyplot()
    monkeypatch.delenv("MPLBACKEND")
    plt = pyplot()  # pyplot imported by now: its backend is chosen
    assert chosen == [] and plt.get_backend()
