"""One batching policy for ``generate_many`` and the server: segment prompts and requests whose reuse needs repair
keep it, in batches."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model
from helpers import word_tokenizer, words

from kvboost_hf import KVBoost
from kvboost_hf.hf.decode import DecodeRequest


@pytest.fixture(scope="module")
def engine():
    return KVBoost(make_tiny_model("llama", seed=0), word_tokenizer(), chunking=8)


def test_generate_many_batches_segment_prompts_with_plain_prompts_and_keeps_their_repair(engine, monkeypatch):
    """Two RAG prompts (segments: a question prefix, warmed documents in another order, a question) and three plain
    prompts run in one decode loop: each RAG prompt is prefilled alone in a cache built with its own segment starts
    and joined, so its content-key hits, repair, reuse figures and tokens equal what it gets alone (from the same
    store contents), and every plain row equals its greedy tokens."""
    documents = [words(50, 24), words(54, 17)]
    rag = [[words(51, 5), documents[1], documents[0], words(52, 6)], [words(55, 3), documents[0], words(56, 4)]]
    others = [words(57 + i, 12 + i) for i in range(3)]

    def warm_documents_only() -> None:
        engine.store.clear()
        for document in documents:
            engine.warm(document)

    alone = []
    for prompt in rag:
        warm_documents_only()
        alone.append(engine.generate(prompt, max_new_tokens=6))
    assert all(result.approx_tokens > 0 for result in alone)
    plain = [engine.generate(prompt, max_new_tokens=6, mode="baseline") for prompt in others]
    warm_documents_only()
    loops = []
    decode_loop = engine.decode_loop

    def counted_loop(*args, **kwargs):
        loops.append(decode_loop(*args, **kwargs))
        return loops[-1]

    monkeypatch.setattr(engine, "decode_loop", counted_loop)
    results = engine.generate_many([others[0], rag[0], others[1], rag[1], others[2]], max_new_tokens=6)
    assert len(loops) == 1  # one batch, one decode loop for the five rows
    for got, expected in zip([results[1], results[3]], alone, strict=True):
        figures = ("output_ids", "cached_tokens", "approx_tokens", "recomputed_tokens", "prompt_tokens")
        assert [getattr(got, name) for name in figures] == [getattr(expected, name) for name in figures]
    for got, expected in zip([results[0], results[2], results[4]], plain, strict=True):
        assert got.output_ids == expected.output_ids


def test_prompts_needing_repair_are_prefilled_alone_and_decode_in_the_batch(engine):
    """Plain prompts holding a warmed document after new text (content-key hits at chunk boundaries) share a
    batch with other prompts: each is prefilled alone (the repair is made for one row at a time), joined, and
    decoded with the others; every row's tokens and reuse equal what it gets alone."""
    documents = [words(80 + i, 24) for i in range(2)]
    for document in documents:
        engine.warm(document)
    repaired = [f"{words(90 + i, 8)} {document}" for i, document in enumerate(documents)]
    prompts = [repaired[0], words(95, 10), repaired[1], words(96, 13)]
    policy = engine.batch_policy()
    assert [policy.prefill_alone(engine.encode(p), None) for p in prompts] == [True, False, True, False]
    rows = engine.new_rows([DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=6) for p in prompts])
    works = policy.prefill_works(rows, None)  # the plain rows together, then each repaired prompt alone
    assert [[rows.index(row) for row in work.rows] for work in works] == [[1, 3], [0], [2]]
    alone = [engine.generate(prompt, max_new_tokens=6) for prompt in prompts]
    assert alone[0].approx_tokens > 0 and alone[2].approx_tokens > 0
    batch = engine.generate_batch(prompts, max_new_tokens=6)  # the store now holds more (written back): equal
    # outputs and repairs, not equal loaded-token counts
    for got, expected in zip(batch, alone, strict=True):
        assert (got.output_ids, got.approx_tokens) == (expected.output_ids, expected.approx_tokens)
    assert engine.generate_many(prompts, max_new_tokens=6)[2].output_ids == alone[2].output_ids


def test_choices_of_one_prompt_are_prefilled_once_and_all_get_the_repair(engine):
    """The n rows of one prompt (a request's choices) are prefilled as one row and repeated: each row keeps the
    approximate hits that a batch of different prompts would lose."""
    document = words(60, 24)
    engine.warm(document)
    prompt = [words(61, 7), document, words(62, 4)]
    alone = engine.generate(prompt, max_new_tokens=5)
    choices = engine.generate_batch([prompt, prompt, prompt], max_new_tokens=5)
    assert alone.approx_tokens > 0
    assert all(r.approx_tokens == alone.approx_tokens and r.output_ids == alone.output_ids for r in choices)


def test_token_id_prompts_are_checked_against_the_vocabulary(engine):
    assert engine.encode([5, 6, 7]) == [5, 6, 7]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.encode([5, 100000])


def test_a_job_submitted_while_the_scheduler_reads_the_store_is_queued_at_once(engine, monkeypatch):
    """The worker plans prefills (which may read a remote store) outside the lock ``submit`` takes: with the store's
    read stalled mid-plan, another job is still accepted at once, and every job finishes once the read returns."""
    import threading
    import time

    from kvboost_hf.server.batching import Done, Job, JobParams
    from kvboost_hf.server.settings import ServerConfig
    from kvboost_hf.server.worker import Worker

    reading, release = threading.Event(), threading.Event()
    contains_many = engine.store.contains_many

    def stalled(keys):
        reading.set()
        assert release.wait(30), "the test releases the read"
        return contains_many(keys)

    monkeypatch.setattr(engine.store, "contains_many", stalled)
    worker = Worker(engine, ServerConfig(reuse_mode="chunk", batch_window_ms=0, max_batch_size=4))
    finished: list[int] = []
    jobs = [
        Job(
            engine.encode(words(70 + i, 20)),
            JobParams(max_tokens=2),
            lambda e, i=i: finished.append(i) if isinstance(e, Done) else None,
        )
        for i in range(3)
    ]
    worker.submit(jobs[0])
    worker.submit(jobs[1])  # two prompts admitted together: the plan asks the store which to prefill alone
    worker.start()
    try:
        assert reading.wait(30)
        started = time.perf_counter()
        worker.submit(jobs[2])
        assert time.perf_counter() - started < 1.0 and worker.queue_depth == 1
        release.set()
        deadline = time.monotonic() + 60
        while len(finished) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(finished) == [0, 1, 2]
    finally:
        release.set()
        worker.shutdown(grace_s=5)


def test_generate_many_of_no_prompts_is_empty_and_generate_batch_refuses_them(engine):
    assert engine.generate_many([]) == []
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate_batch([])
