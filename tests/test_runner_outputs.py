"""The runner's outputs (``DecodeLoop.add`` / ``step`` return :class:`~kvboost_hf.hf.decode.RowOutput`s and append
nothing): log-probabilities of tokens taken down a draft tree equal those of plain decoding, and the oracle's; a stop
string found inside a verify round ends the row exactly there."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, make_tiny_model, noisy_copy
from helpers import as_text, finish, new_loop, prefill, run_loop

from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, PrefillWork
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, Drafter


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (17, 8)]


def test_the_runner_appends_nothing_and_returns_each_rows_first_token(model):
    loop = DecodeLoop(model, new_cache=None, pad_token_id=0)
    greedy_settings = SamplingConfig(temperature=0)
    requests = [DecodeRequest(prompt_ids=p, max_new_tokens=3, sampling=greedy_settings) for p in prompts()]
    rows = loop.rows_for(requests, set())
    outputs = loop.add(PrefillWork(tuple(rows)))
    assert [output.row for output in outputs] == rows and all(not row.tokens for row in rows)
    for output, prompt in zip(outputs, prompts(), strict=True):
        alone, _ = greedy(model, torch.tensor([prompt]), new=1)
        assert output.tokens == (alone[0, -1].item(),) and output.draft is None


def test_logprobs_down_a_draft_tree_equal_plain_decodings(model):
    draft = Drafter(noisy_copy(model, 0.3, seed=2), DraftConfig(num_draft_tokens=3, tree_budget=6))
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=9, sampling=SamplingConfig(temperature=0), top_logprobs=top)
        for p, top in zip(prompts(), (2, None), strict=True)
    ]
    plain = run_loop(model, requests).rows
    drafted = run_loop(model, requests, draft=draft).rows
    assert drafted[0].draft_accepted > 0  # tokens were taken down the tree
    assert [row.tokens for row in drafted] == [row.tokens for row in plain]
    assert drafted[1].logprobs == [] and len(drafted[0].logprobs) == len(drafted[0].tokens)
    for got, want in zip(drafted[0].logprobs, plain[0].logprobs, strict=True):
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_a_stop_string_inside_a_verify_round_ends_the_row_there(model):
    prompt = prompts()[0]
    alone, _ = greedy(model, torch.tensor([prompt]), new=9)
    expected = alone[0, len(prompt) :].tolist()
    cut = next(i for i in range(2, len(expected)) if expected[i] not in expected[:i])
    request = DecodeRequest(
        prompt_ids=prompt, max_new_tokens=9, sampling=SamplingConfig(temperature=0), stop=(f"<{expected[cut]}>",)
    )
    draft = Drafter(model, DraftConfig(num_draft_tokens=4))  # the target as its own draft: every proposal taken
    loop = new_loop(model, draft=draft)
    prefill(loop, [request], eos=set())
    (row,) = finish(loop).rows
    assert row.tokens == expected[: cut + 1] and row.text == as_text(expected[:cut]) and row.finish_reason == "stop"
    assert sum(accepted + 1 for accepted, _ in row.draft_rounds) == len(row.tokens)  # rounds count kept tokens
