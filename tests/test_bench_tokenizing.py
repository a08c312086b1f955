"""The tokenizing benchmark on the embedded tokenizer, small: both ways give the tokenizer's ids (the benchmark
raises otherwise), a warm chat turn tokenizes about its new messages, and a later question on a document only the
question and the document's last line."""

from __future__ import annotations

from kvboost_hf.bench import tokenizing


def test_the_benchmark_counts_what_each_way_tokenizes():
    result = tokenizing.run(
        turns=3, repeats=1, system_chars=1500, message_chars=100, answer_chars=80, model=None,
        document_tokens=2000, questions=3,
    )  # fmt: skip
    assert result["segmented"] and result["continues"]
    assert result["warm_chars_over_new_chars_max"] < 1.1
    first, *later = result["document_questions"]
    assert first["cached_chars"] == first["whole_chars"] == first["prompt_chars"]  # cold
    for row in later:
        assert row["whole_chars"] == row["prompt_chars"] > 5000
        assert row["new_message_chars"] <= row["cached_chars"] < row["new_message_chars"] + 200
    assert "question" in tokenizing.report(result)
