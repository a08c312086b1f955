"""The decode loop shared by the engine and the server, on a tiny random model (no tokenizer: tokens as text)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from conftest import greedy, make_tiny_model, noisy_copy
from helpers import (
    DECODE_CHUNKING,
    DECODE_EOS,
    as_text,
    finish,
    new_loop,
    prefill,
    prefill_in_chunks,
    reuse_caches,
    run_loop,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import reference

from kvboost_hf import ChunkReuseCache, ChunkStore, SamplingConfig
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.keys import content_key
from kvboost_hf.hf import rows as rows_module
from kvboost_hf.hf.cache import select_columns
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest
from kvboost_hf.hf.detokenize import visible_text
from kvboost_hf.hf.speculative import DraftConfig, Drafter


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


GREEDY_PARAMS = SamplingConfig(temperature=0)


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])
def any_window_model(request):
    """Full attention (llama), sliding windows on every layer (mistral) and alternating (gemma2); windows of 8 tokens,
    shorter than the prompts, so rows attend through the window while their chunks are written back."""
    window = {} if request.param == "llama" else {"sliding_window": 8}
    return make_tiny_model(request.param, **window)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (21, 9, 30)]


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_greedy_rows_in_a_batch_equal_generate_alone(any_window_model, reuse):
    model = any_window_model
    store = ChunkStore() if reuse else None
    budgets = [6, 3, 8]
    greedy_params = SamplingConfig(temperature=0)
    for _ in range(2 if reuse else 1):  # with reuse: cold, then loading what the first pass stored
        loop = run_loop(
            model,
            [
                DecodeRequest(prompt_ids=p, max_new_tokens=b, sampling=greedy_params)
                for p, b in zip(prompts(), budgets, strict=True)
            ],
            store,
        )
        for row, prompt, budget in zip(loop.rows, prompts(), budgets, strict=True):
            alone, _ = greedy(model, torch.tensor([prompt]), new=budget)
            assert row.tokens == alone[0, len(prompt) :].tolist()
            assert row.finish_reason == "length" and row.text == as_text(row.tokens)
    if reuse:
        cached = [row.reuse.cached_tokens for row in loop.rows]
        assert cached == [15, 3, 24]  # a batch loads the same columns for every row: 3 chunks of the widest row
        assert loop.computed_tokens == sum(len(p) for p in prompts()) - sum(cached)


SAMPLED = [  # every processor the loop builds, over the rows
    SamplingConfig(temperature=1.3, top_k=40, seed=11),
    SamplingConfig(temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.3, logit_bias=((7, 3.0),), seed=3),
    SamplingConfig(presence_penalty=0.6, frequency_penalty=0.4, min_tokens=5, stop_token_ids=(9,), seed=5),
]


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_seeded_rows_in_a_batch_draw_what_transformers_generate_draws_alone(model, reuse):
    """Each seeded row of a mixed batch equals transformers' ``generate()`` of its prompt alone under
    ``torch.manual_seed(seed)`` with the row's processors (the oracle module says why the draws can match)."""
    store = ChunkStore() if reuse else None
    for _ in range(2 if reuse else 1):
        loop = run_loop(
            model,
            [
                DecodeRequest(prompt_ids=p, max_new_tokens=10, sampling=s)
                for p, s in zip(prompts(), SAMPLED, strict=True)
            ],
            store,
        )
        for row, prompt, sampling in zip(loop.rows, prompts(), SAMPLED, strict=True):
            assert row.tokens == reference(model, prompt, 10, sampling, DECODE_EOS).tokens
    reseeded = replace(SAMPLED[0], seed=12)
    assert (
        run_loop(model, [DecodeRequest(prompt_ids=prompts()[0], max_new_tokens=10, sampling=reseeded)]).rows[0].tokens
        != loop.rows[0].tokens
    )


def test_unseeded_rows_follow_torch_manual_seed(model):
    request = DecodeRequest(prompt_ids=prompts()[1], max_new_tokens=8, sampling=SamplingConfig(temperature=1.0))
    torch.manual_seed(0)
    first = run_loop(model, [request]).rows[0].tokens
    torch.manual_seed(0)
    assert run_loop(model, [request]).rows[0].tokens == first


def test_stop_strings_end_rows_exactly_and_end_tokens_stop(model):
    prompt = prompts()[2]
    full = (
        run_loop(model, [DecodeRequest(prompt_ids=prompt, max_new_tokens=8, sampling=SamplingConfig(temperature=0))])
        .rows[0]
        .tokens
    )
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])  # a token seen there for the first time
    stopped = run_loop(
        model,
        [
            DecodeRequest(
                prompt_ids=prompt, max_new_tokens=8, sampling=SamplingConfig(temperature=0), stop=(f"<{full[cut]}>",)
            )
        ],
    ).rows[0]
    assert stopped.tokens == full[: cut + 1] and stopped.text == as_text(full[:cut])
    assert stopped.finish_reason == "stop"
    ended = run_loop(
        model,
        [
            DecodeRequest(
                prompt_ids=prompt, max_new_tokens=8, sampling=SamplingConfig(temperature=0, stop_token_ids=(full[cut],))
            )
        ],
    ).rows[0]
    assert ended.tokens == full[: cut + 1] and ended.finish_reason == "stop"


def test_cancel_ends_only_that_row_and_rows_report_every_token(model):
    cancel = threading.Event()
    seen: list[tuple[int, int]] = []

    def on_token(row) -> None:
        seen.append((id(row), row.tokens[-1]))
        if row.request.cancel is cancel and len(row.tokens) == 2:
            cancel.set()

    requests = [
        DecodeRequest(prompt_ids=prompts()[0], max_new_tokens=8, sampling=SamplingConfig(temperature=0), cancel=cancel),
        DecodeRequest(prompt_ids=prompts()[1], max_new_tokens=8, sampling=SamplingConfig(temperature=0)),
    ]
    loop = run_loop(model, requests, on_token=on_token)
    cancelled, other = loop.rows
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 3
    assert other.finish_reason == "length" and len(other.tokens) == 8
    assert [t for r, t in seen if r == id(other)] == other.tokens


def test_logprobs_and_first_logits_are_the_models_unscaled_distribution(model):
    prompt = prompts()[0]
    request = DecodeRequest(
        prompt_ids=prompt,
        max_new_tokens=4,
        sampling=SamplingConfig(temperature=0.5, seed=1),
        top_logprobs=3,
        keep_first_logits=True,
    )
    row = run_loop(model, [request]).rows[0]
    _, logits = greedy(model, torch.tensor([prompt]), new=1)
    torch.testing.assert_close(row.first_logits, logits[0, 0])
    first = torch.log_softmax(logits[0, 0], dim=-1)
    assert row.logprobs[0].logprob == pytest.approx(float(first[row.tokens[0]]), abs=1e-5)
    assert [t for t, _ in row.logprobs[0].top] == first.topk(3).indices.tolist()
    assert [entry.token for entry in row.logprobs] == row.tokens


def test_rows_sharing_a_new_prefix_compute_it_once(model):
    store = ChunkStore()
    head = prompts()[2][:24]  # three full chunks
    rows = [[*head, 5, 6, 7], [*head, 9, 10, 12], [*head, 11, 13, 14]]  # same length: no padding
    loop = run_loop(
        model,
        [DecodeRequest(prompt_ids=p, max_new_tokens=2, sampling=SamplingConfig(temperature=0)) for p in rows],
        store,
    )
    assert loop.computed_tokens == 24 + 3 * 3  # the head once, then each row's own tail
    assert [row.reuse.cached_tokens for row in loop.rows] == [0, 24, 24]  # the first row computed it
    for row, prompt in zip(loop.rows, rows, strict=True):
        alone, _ = greedy(model, torch.tensor([prompt]), new=2)
        assert row.tokens == alone[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt_ids is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"segment_starts": (0, 3)}, r"segment starts \[3\] lie outside the prompt's 2 tokens"),
    ],
)
def test_bad_requests_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeRequest(**{"prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_rows_joining_a_running_batch_equal_generate_alone(any_window_model, reuse):
    """Continuous batching: rows that join mid-generation (shorter and longer prompts than the running rows) get
    the tokens they get alone, the running rows are undisturbed, and the next step is one forward for all."""
    model = any_window_model
    store = ChunkStore() if reuse else None
    new_cache = reuse_caches(store, model)
    greedy_params = SamplingConfig(temperature=0)
    first, *later = prompts()
    loop = new_loop(model, new_cache)
    prefill(loop, [DecodeRequest(prompt_ids=first, max_new_tokens=9, sampling=greedy_params)])
    loop.step()
    loop.step()
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=5, sampling=greedy_params) for p in later])
    assert len(loop.running) == 3
    forwards = loop.forwards
    loop.step()
    assert loop.forwards == forwards + 1  # one forward for the old row and the two new ones
    while not loop.done:
        loop.step()
    for row, prompt in zip(loop.rows, [first, *later], strict=True):
        alone, _ = greedy(model, torch.tensor([prompt]), new=row.request.max_new_tokens)
        assert row.tokens == alone[0, len(prompt) :].tolist()
    if reuse:  # the joined rows' chunks were written back from the merged cache
        again = run_loop(
            model, [DecodeRequest(prompt_ids=p, max_new_tokens=1, sampling=greedy_params) for p in later], store
        )
        assert all(row.reuse.cached_tokens > 0 for row in again.rows)


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_rows_left_after_a_wide_row_leaves_drop_its_padding_and_equal_generate_alone(any_window_model, reuse):
    """A 100-token prompt joins two short running rows (widening them to its width) and leaves after 2 tokens: the
    batch drops the leading columns that are padding for both rows left (its caches and mask as wide as their
    contexts again), and they still take the tokens they take alone; with reuse, what they write back is what a
    batch that never held the wide row writes (a later run loads the same chunks)."""
    model = any_window_model
    store = ChunkStore() if reuse else None
    greedy_params = SamplingConfig(temperature=0)
    generator = torch.Generator().manual_seed(9)
    short = [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (11, 6)]
    wide = torch.randint(1, 120, (100,), generator=generator).tolist()
    loop = new_loop(model, reuse_caches(store, model))
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=12, sampling=greedy_params) for p in short])
    loop.step()
    prefill(loop, [DecodeRequest(prompt_ids=wide, max_new_tokens=2, sampling=greedy_params)])
    assert loop.mask.shape[1] == 100
    loop.step()  # the wide row's second token: it leaves, the short rows go on
    assert len(loop.running) == 2 and loop.mask.shape[1] == 11 + 2  # the longer short prompt and 2 tokens fed since
    assert loop.cache.get_seq_length() == loop.mask.shape[1]
    finish(loop)
    for row, prompt in zip(loop.rows, [*short, wide], strict=True):
        alone, _ = greedy(model, torch.tensor([prompt]), new=row.request.max_new_tokens)
        assert row.tokens == alone[0, len(prompt) :].tolist()
    if reuse:  # each short row's context was written back whole, and loading it gives the next token alone
        contexts = [prompt + row.tokens for prompt, row in zip(short, loop.rows, strict=False)]
        again = run_loop(
            model, [DecodeRequest(prompt_ids=c, max_new_tokens=1, sampling=greedy_params) for c in contexts], store
        )
        assert [row.reuse.cached_tokens for row in again.rows] == [11 + 12 - 1, 6 + 12 - 1]  # all but the last
        for row, context in zip(again.rows, contexts, strict=True):
            alone, _ = greedy(model, torch.tensor([context]), new=1)
            assert row.tokens == alone[0, len(context) :].tolist()


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_prompts_prefilled_in_chunks_between_steps_equal_generate_alone(any_window_model, reuse):
    """Chunked prefill: rows of different lengths (left-padded in one forward) join a running row 7 columns per
    call, the running row decoding between the calls; with reuse one prompt's first 16 tokens are stored, loaded,
    and only the rest is computed in chunks. Every row gets transformers' tokens for its prompt alone."""
    model = any_window_model
    store = ChunkStore() if reuse else None
    first, *later = prompts()  # 21, then 9 and 30 tokens
    if store is not None:  # two chunks of the longest prompt stored
        run_loop(model, [DecodeRequest(prompt_ids=later[1][:16], max_new_tokens=1)], store)
    loop = new_loop(model, reuse_caches(store, model))
    prefill(loop, [DecodeRequest(prompt_ids=first, max_new_tokens=12, sampling=GREEDY_PARAMS)])
    requests = [
        DecodeRequest(prompt_ids=p, max_new_tokens=6, sampling=GREEDY_PARAMS, keep_first_logits=True) for p in later
    ]
    partial = prefill_in_chunks(loop, requests, columns=7)
    assert partial == (1 if reuse else 4)  # 30 - 16 loaded = 14 columns in 2 calls; else 30 in 5
    finish(loop)
    for row in loop.rows:
        expected = reference(model, row.request.prompt_ids, row.request.max_new_tokens, eos_token_ids=DECODE_EOS)
        assert row.tokens == expected.tokens
        if row.first_logits is not None:  # the joined rows': their prompt forward's last position
            torch.testing.assert_close(row.first_logits, expected.first_logits, atol=1e-4, rtol=1e-4)
    if reuse:
        assert [row.reuse.cached_tokens for row in loop.rows[1:]] == [0, 16]


def test_a_repeated_prompt_chunked_with_a_draft_equals_generate_alone(model, noisy_draft):
    """The ``n`` choices of one prompt are prefilled once in chunks (one forward row per chunk), then repeated; with
    a draft, the chunked prompt forward verifies no tree (the draft prefills after), and every row still gets
    transformers' tokens."""
    drafter = Drafter(noisy_draft, DraftConfig(num_draft_tokens=3), None)
    loop = new_loop(model, draft=drafter)
    prompt = prompts()[2]
    prefill(loop, [DecodeRequest(prompt_ids=prompts()[1], max_new_tokens=20, sampling=GREEDY_PARAMS)])
    requests = [DecodeRequest(prompt_ids=prompt, max_new_tokens=9, sampling=GREEDY_PARAMS, keep_first_logits=True)]
    assert prefill_in_chunks(loop, requests * 2, columns=8) == 3  # 30 columns in 4 calls
    assert len(loop.running) == 3
    finish(loop)
    expected = reference(model, prompt, 9, eos_token_ids=DECODE_EOS)
    assert [row.tokens for row in loop.rows[1:]] == [expected.tokens, expected.tokens]
    for row in loop.rows[1:]:
        torch.testing.assert_close(row.first_logits, expected.first_logits, atol=1e-4, rtol=1e-4)
    assert loop.rows[0].tokens == reference(model, prompts()[1], 20, eos_token_ids=DECODE_EOS).tokens


class RecordingStore(ChunkStore):
    """A RAM store that remembers the keys put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def put(self, key: str, entry: ChunkKV) -> None:
        self.keys.append(key)
        super().put(key, entry)


def segment_prompt(first: list[int], second: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """A header, two documents and a question as one prompt (tokens 1..119), and its segment starts."""
    generator = torch.Generator().manual_seed(len(first) * 131 + first[0])
    header, question = (torch.randint(1, 120, (n,), generator=generator).tolist() for n in (5, 6))
    return [*header, *first, *second, *question], (0, 5, 5 + len(first), 5 + len(first) + len(second))


def segment_loop(model, store: ChunkStore, requests: list[DecodeRequest], draft: Drafter | None = None) -> DecodeLoop:
    """A loop with ``requests`` prefilled, segment prompts alone (each in a cache built with its segment starts), as
    the engine's batch policy plans them."""
    loop = new_loop(model, reuse_caches(store, model), draft=draft)
    prefill(loop, requests, alone=lambda prompt_ids, segment_starts: bool(segment_starts))
    return loop


@pytest.fixture(scope="module")
def documents() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, 120, (n,), generator=generator).tolist() for n in (20, 13)]


def test_a_segment_row_decodes_with_plain_rows_and_writes_back_what_it_writes_alone(model, documents):
    """A row with segment starts is prefilled in a cache built with them and joined to plain rows: after the prefill
    every step is one forward for all rows, each row gets its greedy tokens alone, and the segment row's chunks are
    stored under the keys (prefix and content, chunked at its segment starts) and with the K/V it stores alone,
    though the cache it was joined into has no segment starts."""
    prompt, starts = segment_prompt(*documents)
    greedy_params = SamplingConfig(temperature=0)
    segment = DecodeRequest(prompt_ids=prompt, max_new_tokens=6, sampling=greedy_params, segment_starts=starts)
    plain = [DecodeRequest(prompt_ids=p, max_new_tokens=6, sampling=greedy_params) for p in prompts()[:2]]
    alone_store = RecordingStore()
    run_loop(model, [segment], alone_store)
    namespace = ChunkReuseCache(alone_store, model, DECODE_CHUNKING, adapter=False).namespace
    assert content_key(namespace, documents[0][:8]) in alone_store.keys  # a document chunk, by content key
    store = ChunkStore()
    loop = segment_loop(model, store, [plain[0], segment, plain[1]])
    assert len(loop.running) == 3 and loop.forwards == 2  # the plain rows' prefill, then the segment row's
    loop.step()
    assert loop.forwards == 3  # one decode forward for the three rows
    while not loop.done:
        loop.step()
    for row in loop.rows:
        prompt_ids = list(row.request.prompt_ids)
        alone, _ = greedy(model, torch.tensor([prompt_ids]), new=6)
        assert row.tokens == alone[0, len(prompt_ids) :].tolist()
    for key in alone_store.keys:
        joined, expected = store.get(key), alone_store.get(key)
        assert joined is not None and expected is not None, "the joined row stored what it stores alone"
        torch.testing.assert_close(joined.keys, expected.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(joined.values, expected.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft"])
def test_reordered_documents_hit_by_content_key_in_a_batch_as_alone(model, noisy_draft, documents, speculative):
    """Documents stored by a segment prompt are hit by content key in another order by a segment row that shares
    its batch with plain rows: its reuse figures and tokens equal those it gets alone (same store contents). With a
    draft, the draft's cache for that row is built with its segment starts too (its chunks stored by content key in
    the draft's namespace)."""
    greedy_params = SamplingConfig(temperature=0)
    stores = [ChunkStore(), ChunkStore()]
    first, first_starts = segment_prompt(*documents)
    for store in stores:
        run_loop(
            model,
            [DecodeRequest(prompt_ids=first, max_new_tokens=1, sampling=greedy_params, segment_starts=first_starts)],
            store,
        )
    reordered, starts = segment_prompt(*documents[::-1])
    segment = DecodeRequest(prompt_ids=reordered, max_new_tokens=6, sampling=greedy_params, segment_starts=starts)
    alone = run_loop(model, [segment], stores[0]).rows[0]
    assert alone.reuse.approx_tokens > 0
    requests = [DecodeRequest(prompt_ids=p, max_new_tokens=6, sampling=greedy_params) for p in prompts()[:2]] + [
        segment
    ]
    draft = Drafter(noisy_draft, DraftConfig(num_draft_tokens=3), reuse_caches(stores[1], noisy_draft))
    loop = finish(segment_loop(model, stores[1], requests, draft if speculative else None))
    assert loop.rows[2].reuse == alone.reuse and loop.rows[2].tokens == alone.tokens
    if not speculative:
        assert loop.forwards == 2 + 5  # two prefills, then five decode steps shared by the three rows
        return
    draft_namespace = ChunkReuseCache(stores[1], noisy_draft, DECODE_CHUNKING, adapter=False).namespace
    assert stores[1].contains(content_key(draft_namespace, documents[1][:8]))  # the first document's first chunk


def test_rows_with_different_segment_starts_are_not_prefilled_in_one_cache(model, documents):
    prompt, starts = segment_prompt(*documents)
    rows = [
        DecodeRequest(prompt_ids=prompt, max_new_tokens=2, segment_starts=starts),
        DecodeRequest(prompt_ids=prompts()[0], max_new_tokens=2),
    ]
    with pytest.raises(ValueError, match="different segment starts"):
        run_loop(model, rows, ChunkStore())
    assert (
        len(run_loop(model, rows).rows) == 2
    )  # without reuse there is no cache to build: segment starts do not matter


texts = st.text(alphabet="abc ", max_size=30)
stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3)


@given(texts, stop_lists)
def test_visible_text_never_shows_a_stop_and_cuts_at_the_first(text, stops):
    visible, stopped = visible_text(text, stops)
    assert text.startswith(visible)
    assert not any(stop in visible for stop in stops)
    rest = text[len(visible) :]
    if stopped:
        assert any(rest.startswith(stop) for stop in stops)
    else:  # what is held back could still become a stop
        assert not any(stop in text for stop in stops)
        assert rest == "" or any(stop.startswith(rest) and stop != rest for stop in stops)


@given(texts, stop_lists)
def test_streamed_text_is_never_taken_back(text, stops):
    """What a stream has sent stays a prefix of what it sends later, up to and including the stop."""
    sent = ""
    for end in range(len(text) + 1):
        visible, stopped = visible_text(text[:end], stops)
        assert visible.startswith(sent)
        sent = visible
        if stopped:
            break


# ---------------------------------------------------------------------------------------------------- speculative
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_select_columns_keeps_each_rows_columns_right_aligned(data):
    rows = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 7))
    columns = [sorted(data.draw(st.sets(st.integers(0, width - 1)))) for _ in range(rows)]
    out_width = max(len(kept) for kept in columns) + data.draw(st.integers(0, 2))
    tensor = torch.arange(1, rows * width + 1).reshape(rows, width)
    out = select_columns(tensor, columns, dim=1, width=out_width)
    assert out.shape == (rows, out_width)
    for row, kept in enumerate(columns):
        assert out[row].tolist() == [0] * (out_width - len(kept)) + tensor[row, kept].tolist()
    layered = tensor[:, None, :, None].expand(rows, 2, width, 3)  # [B, H, columns, D] as cache layers hold
    expected = out[:, None, :, None].expand(rows, 2, out_width, 3)
    assert torch.equal(select_columns(layered, columns, dim=2, width=out_width), expected)


def test_select_columns_refuses_bad_lists():
    with pytest.raises(ValueError, match="one list per row"):
        select_columns(torch.zeros(2, 3), [[0]], dim=1)
    with pytest.raises(ValueError, match="cannot keep columns"):
        select_columns(torch.zeros(2, 3), [[0, 3], [1]], dim=1)
    with pytest.raises(ValueError, match="cannot keep columns"):
        select_columns(torch.zeros(2, 3), [[0, 1], [1]], dim=1, width=1)


@pytest.fixture(scope="module")
def noisy_draft(model):
    """A copy of the model with noise on its weights: some of its proposals are accepted, others not."""
    return noisy_copy(model, 0.25, seed=3)


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "chunk-reuse"])
def test_speculative_rows_join_and_equal_generate_alone(model, noisy_draft, reuse):
    """With a draft, rows accept different counts per verify, rows join mid-generation, and every row still gets
    transformers' greedy tokens; with reuse the chunks written back (target and draft) are exact: a longer prompt
    that loads them gives the first logits of a full prefill."""
    store = ChunkStore() if reuse else None
    new_cache = reuse_caches(store, model)
    draft_cache = reuse_caches(store, noisy_draft)
    drafter = Drafter(noisy_draft, DraftConfig(num_draft_tokens=3), draft_cache)
    greedy_params = SamplingConfig(temperature=0)
    first, *later = prompts()
    loop = new_loop(model, new_cache, draft=drafter)
    prefill(loop, [DecodeRequest(prompt_ids=first, max_new_tokens=14, sampling=greedy_params)])
    loop.step()
    prefill(loop, [DecodeRequest(prompt_ids=p, max_new_tokens=18, sampling=greedy_params) for p in later])
    while not loop.done:
        loop.step()
    for row, prompt in zip(loop.rows, [first, *later], strict=True):
        alone, _ = greedy(model, torch.tensor([prompt]), new=row.request.max_new_tokens)
        assert row.tokens == alone[0, len(prompt) :].tolist()
    assert 0 < sum(row.draft_accepted for row in loop.rows) < sum(row.draft_proposed for row in loop.rows)
    assert len({row.draft_accepted for row in loop.rows}) > 1
    assert loop.forwards < 2 + 17  # 2 prefills + fewer verifies than the joined rows' 17 later tokens
    if reuse:
        longer = [first + loop.rows[0].tokens + [5, 6, 7]]
        plain = run_loop(
            model,
            [DecodeRequest(prompt_ids=longer[0], max_new_tokens=1, sampling=greedy_params, keep_first_logits=True)],
        )
        loaded = run_loop(
            model,
            [DecodeRequest(prompt_ids=longer[0], max_new_tokens=1, sampling=greedy_params, keep_first_logits=True)],
            store,
        )
        assert loaded.rows[0].reuse.cached_tokens >= len(first)
        assert torch.allclose(loaded.rows[0].first_logits, plain.rows[0].first_logits, atol=1e-4)
        drafted = Drafter(noisy_draft, DraftConfig(), draft_cache)
        drafted.prefill(torch.tensor(longer), torch.ones(1, len(longer[0]), dtype=torch.long),
                        torch.arange(len(longer[0]))[None])  # fmt: skip
        assert drafted.cached_tokens[0] >= len(first)  # the draft's chunks were written back too


def test_a_constrained_row_takes_one_token_per_step_beside_speculating_rows(model, noisy_draft):
    """A row with a (stateful) constraint is never given draft tokens; it sees each of its tokens once."""

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def __call__(self, input_ids, scores):
            self.seen.append(input_ids.shape[1])
            return scores

    recorder = Recorder()
    first, second, _ = prompts()
    temperature_0 = SamplingConfig(temperature=0)
    requests = [
        DecodeRequest(prompt_ids=first, max_new_tokens=10, sampling=temperature_0, constraint=recorder),
        DecodeRequest(prompt_ids=second, max_new_tokens=10, sampling=temperature_0),
    ]
    loop = run_loop(model, requests, draft=Drafter(noisy_draft, DraftConfig(num_draft_tokens=3)))
    constrained, free = loop.rows
    assert recorder.seen == list(range(len(first), len(first) + len(constrained.tokens)))  # once per token, in order
    assert constrained.draft_proposed == 0 and free.draft_proposed > 0
    for row, prompt in ((constrained, first), (free, second)):
        alone, _ = greedy(model, torch.tensor([prompt]), new=10)
        assert row.tokens == alone[0, len(prompt) :].tolist()


def test_decode_request_takes_keywords_only():
    with pytest.raises(TypeError):
        DecodeRequest([1, 2], 4)  # type: ignore[misc]
    request = DecodeRequest(prompt_ids=[1, 2], max_new_tokens=4)
    assert (request.prompt_ids, request.max_new_tokens, request.stop) == ([1, 2], 4, ())


def test_a_rows_processors_read_its_context_from_the_device_sending_only_new_tokens(model, monkeypatch):
    """A row whose processors read ``input_ids`` (penalties) keeps its context in a device buffer and sends only
    the tokens added since its last step (it sent its whole prompt and answer at every step: O(context) host work
    per token); a row whose processors read none (temperature, top-k/p, min-p) sends nothing. Draws unchanged:
    transformers' seeded ``generate()``."""
    sent: list[int] = []
    send = rows_module.to_device

    def counting(values, device):
        sent.append(sum(len(value) if isinstance(value, list) else 1 for value in values))
        return send(values, device)

    monkeypatch.setattr(rows_module, "to_device", counting)
    prompt = prompts()[2]
    penalised = SamplingConfig(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, seed=3)
    loop = run_loop(model, [DecodeRequest(prompt_ids=prompt, max_new_tokens=12, sampling=penalised)], None)
    (row,) = loop.rows
    assert row.tokens == reference(model, prompt, 12, penalised).tokens
    context_sent = sum(sent) - 2 * len(row.tokens)  # each step also sends the row's index and its pick
    assert context_sent == len(prompt) + len(row.tokens) - 1  # once each (the last token is never read)
    sent.clear()
    warped = SamplingConfig(temperature=0.8, top_k=20, seed=3)
    loop = run_loop(model, [DecodeRequest(prompt_ids=prompt, max_new_tokens=12, sampling=warped)], None)
    assert sum(sent) == 2 * len(loop.rows[0].tokens) and not loop.rows[0].reads_ids
