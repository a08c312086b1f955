"""The runner's forward routes (``hf/forward_routes.py``'s :class:`ForwardRouter`): which target forwards of a decode
loop run through the compiled graphs and which eagerly, each counted once, with generate()'s tokens either way."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import DECODE_EOS, finish, new_loop, prefill, reuse_caches
from oracle import reference

from kvboost_hf import ChunkStore
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest
from kvboost_hf.hf.graphs import GraphConfig, GraphedDecoder
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig, Drafter
from kvboost_hf.store.config import StoreConfig

BUDGET = 6
FIRST_TURN = list(range(3, 43))
NEW_MESSAGE = list(range(5, 24))
GREEDY = SamplingConfig(temperature=0)


def two_turns(target, graphs: GraphedDecoder, draft=None) -> tuple[list[list[int]], DecodeLoop]:
    """A chat's two turns in one reuse loop on a fresh store, with ``graphs`` (speculative with ``draft`` when given):
    the first turn, then the second (the first, its answer and a new message: a prompt forward whose uncached tail
    follows the first turn's reused K/V). Returns both prompts and the loop."""
    store = ChunkStore(StoreConfig(1 << 24))
    drafter = None
    if draft is not None:
        drafter = Drafter(draft, DraftConfig(num_draft_tokens=3), reuse_caches(store, draft, adapter=False))
    loop = new_loop(target, reuse_caches(store, target, adapter=False), graphs=graphs, draft=drafter)
    prefill(loop, [DecodeRequest(prompt_ids=FIRST_TURN, max_new_tokens=BUDGET, sampling=GREEDY)])
    finish(loop)
    second = FIRST_TURN + loop.rows[0].tokens + NEW_MESSAGE
    prefill(loop, [DecodeRequest(prompt_ids=second, max_new_tokens=BUDGET, sampling=GREEDY)])
    finish(loop)
    return [FIRST_TURN, second], loop


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_plain_steps_and_warm_prompt_forwards_run_graphed_only_without_a_draft(target, draft, speculative):
    """The same two turns with the graphs: without a draft every decode step and the warm turn's prompt forward run
    graphed (the cold first prompt forward, with no reused column, eagerly), each counted once in the loop's
    forwards; with a draft none of them touches the graphs (the draft's cache follows the target's layout) and the
    verify forwards, with no verify graphs, run eagerly. The tokens are generate()'s either way."""
    graphs = GraphedDecoder(target, GraphConfig(backend="eager"))
    torch._dynamo.reset()
    prompts, loop = two_turns(target, graphs, draft if speculative else None)
    assert [row.tokens for row in loop.rows] == [
        reference(target, prompt, BUDGET, eos_token_ids=DECODE_EOS).tokens for prompt in prompts
    ]
    counters = (graphs.graphed_steps, graphs.eager_steps, graphs.graphed_prefills, graphs.eager_prefills)
    if speculative:
        assert counters == (0, 0, 0, 0) and loop.verify_forwards > 0
        assert loop.draft is not None and sum(row.draft_accepted for row in loop.rows) > 0
    else:
        steps = sum(len(row.tokens) - 1 for row in loop.rows)  # a row's first token comes from its prompt forward
        assert counters == (steps, 0, 1, 0) and steps > 0
        assert loop.forwards == 2 + steps  # two prompt forwards (the warm one graphed), then one forward per step
