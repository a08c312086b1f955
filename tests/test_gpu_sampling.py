"""GPU-only (``pytest -m gpu``): a decode step's sampling of plain greedy rows (argmax, log-probabilities and top-k
on the device) reaches the host in one synchronising transfer, with the values the CPU computes. Skipped without
CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvboost_hf.hf.rows import DecodeRequest, Sampled, new_rows
from kvboost_hf.hf.sampling import SamplingConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]


def rows(tops: list[int | None]):
    requests = [
        DecodeRequest(prompt_ids=[1], max_new_tokens=4, sampling=SamplingConfig(temperature=0), top_logprobs=top)
        for top in tops
    ]
    return new_rows(requests, set())


@pytest.mark.parametrize("tops", [[None, None, None, None], [2, 2, 2, 2], [None, 3, None, 0]])
def test_sampling_plain_greedy_rows_synchronises_once_and_equals_the_cpu(tops):
    batch = rows(tops)
    logits = torch.randn(len(batch), 4096, generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sampled = Sampled(batch, logits, logits.argmax(dim=-1))
            outputs = sampled.outputs(sampled.packed.tolist())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's one-time notice "Synchronization debug mode is a prototype feature ..." is not a synchronisation
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
    on_cpu = logits.cpu()
    on_host = Sampled(batch, on_cpu, on_cpu.argmax(dim=-1))
    expected = on_host.outputs(on_host.packed.tolist())
    assert [output.tokens for output in outputs] == [output.tokens for output in expected]
    for got_output, want_output in zip(outputs, expected, strict=True):
        assert (
            len(got_output.logprobs) == len(want_output.logprobs) == (got_output.row.request.top_logprobs is not None)
        )
        for got, want in zip(got_output.logprobs, want_output.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)
