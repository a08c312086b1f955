"""The rag_server benchmark's measures, on fabricated records (no server): fast."""

from __future__ import annotations

import pytest

from kvboost_hf.bench.rag_server import Record, document_texts, summarize


def test_summary_compares_each_way_with_the_cold_answer_of_the_same_query():
    records = [
        Record(0, "cold", 1000.0, 100, 0, "4821"),
        Record(0, "plain", 900.0, 100, 10, "4821"),
        Record(0, "parts", 250.0, 100, 80, "4800"),
        Record(1, "cold", 1200.0, 120, 0, "7310"),
        Record(1, "plain", 1100.0, 120, 20, "7310"),
        Record(1, "parts", 350.0, 120, 100, "7310"),
    ]
    summary = summarize(records)
    assert summary["cold"]["answers_equal_cold"] == 1.0 and summary["cold"]["speedup_vs_cold"] == 1.0
    assert summary["parts"]["answers_equal_cold"] == 0.5
    assert summary["parts"]["cached_share"] == pytest.approx(180 / 220)
    # nearest-rank p50 of two values is the higher one: cold's p50 over the way's p50
    assert summary["parts"]["speedup_vs_cold"] == pytest.approx(1200 / 350)
    assert summary["plain"]["ttft_p50_ms"] == 1100.0


def test_documents_are_cut_and_end_with_one_newline():
    docs = document_texts(3, 200)
    assert len(docs) == 3 and all(doc.endswith("\n") and not doc.endswith("\n\n") for doc in docs)
    assert all(len(doc) <= 200 + 80 for doc in docs)  # a title line, then at most 200 characters of body
    with pytest.raises(ValueError, match="corpus holds"):
        document_texts(10_000, 200)
