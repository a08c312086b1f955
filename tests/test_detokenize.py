"""Incremental detokenization (``hf/detokenize.py``) against the whole decode of the embedded model's tokenizer: the
text after every token, the visible text and the stop decision equal what decoding the whole answer gives, and the
tokens decoded per token stay flat from a 50- to a 2,000-token answer."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvboost_hf.bench.detokenize import answer_text
from kvboost_hf.hf.decode import DecodeRequest, DecodeRow
from kvboost_hf.hf.detokenize import IncrementalText, visible_text
from kvboost_hf.hf.models import embedded_model_dir

MAX_TOKENS_PER_TOKEN = 8  # issue 37's bound on tokens detokenized per generated token


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def whole_decode(ids: list[int]) -> str:
    """The reference: the answer decoded whole, as the rows' text was decoded before."""
    return tokenizer().decode(ids, skip_special_tokens=True)


class CountingDecode:
    """``decode`` that counts the token ids it is handed, per call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, ids: list[int]) -> str:
        self.calls.append(len(ids))
        return whole_decode(ids)


token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=40)  # the whole vocabulary: bytes, specials


@settings(max_examples=200, deadline=None)
@given(ids=token_ids, data=st.data())
def test_incremental_text_equals_the_whole_decode_after_every_token(ids, data):
    """For random token sequences (split multi-byte characters, invalid bytes, special tokens included) the text
    after each token is the whole decode of the tokens so far; a stop string (a piece of that text, or another)
    is found exactly where the whole text first holds it, and the visible text is :func:`visible_text`'s."""
    full = whole_decode(ids)
    start = data.draw(st.integers(0, max(len(full) - 1, 0)))
    stops = (full[start : start + data.draw(st.integers(1, 4))], data.draw(st.text(alphabet="ab \n", max_size=3)))
    text = IncrementalText(stops)
    for end in range(1, len(ids) + 1):
        text.update(ids[:end], whole_decode)
        expected = whole_decode(ids[:end])
        assert text.text == expected
        visible, stopped = visible_text(expected, stops)
        assert (text.stop_at is not None) == stopped
        assert text.visible(finished=False) == visible
        if stopped:
            assert text.visible(finished=True) == visible
            break
    else:
        assert text.visible(finished=True) == full
    assert text.offsets == [len(whole_decode(ids[:i]).rstrip("\ufffd")) for i in range(len(text.offsets))]


def test_a_stop_prefix_before_an_incomplete_character_is_held_back():
    assert visible_text("用户：\ufffd", ("：你",)) == ("用户", False)
    assert visible_text("Answer: \ufffd\ufffd", (": 你",)) == ("Answer", False)
    assert visible_text("Toky\ufffd", ("o 東",)) == ("Toky", False)


@settings(max_examples=150, deadline=None)
@given(answer=st.text(alphabet="ab :：用户你好東京é😀", min_size=1, max_size=12), data=st.data())
def test_streamed_text_only_grows_with_non_ascii_stops(answer, data):
    """A row's ``text`` streamed as deltas (the server's ``JobRun._report`` sends what it adds): with non-ASCII
    stop strings and characters split over byte tokens, each text extends the one before, so the joined deltas
    equal the final text (text once sent cannot be taken back)."""
    start = data.draw(st.integers(0, len(answer) - 1))
    stop = answer[start : start + data.draw(st.integers(1, 4))]
    ids = tokenizer()(answer, add_special_tokens=False)["input_ids"]
    row = DecodeRow(DecodeRequest(prompt_ids=[1], max_new_tokens=len(ids), stop=(stop,)), 0, frozenset())
    streamed = ""
    for token in ids:
        row.append(token, whole_decode)
        if row.stop_string_found:
            row.finish("stop")
        assert row.text.startswith(streamed), (streamed, row.text)
        streamed = row.text
        if row.finished:
            break
    else:
        row.finish("length")
    assert row.text.startswith(streamed)
    assert row.text == visible_text(whole_decode(ids), (stop,))[0]


def answer_ids(length: int) -> list[int]:
    """``length`` tokens of varied text: words, digits, punctuation, accents, CJK and emoji (characters split
    over several byte tokens)."""
    ids = tokenizer()(answer_text(length), add_special_tokens=False)["input_ids"]
    assert len(ids) >= length
    return ids[:length]


def detokenized_per_token(length: int) -> tuple[float, int]:
    """Mean and most token ids decoded per appended token over a ``length``-token answer, through a row."""
    counting = CountingDecode()
    row = DecodeRow(DecodeRequest(prompt_ids=[1], max_new_tokens=length, stop=("STOP!",)), 0, frozenset())
    worst = 0
    ids = answer_ids(length)
    for token in ids:
        before = sum(counting.calls)
        row.append(token, counting)
        worst = max(worst, sum(counting.calls) - before)
    row.finish("length")
    assert row.text == whole_decode(ids)
    return sum(counting.calls) / length, worst


def test_tokens_detokenized_per_token_stay_flat_from_50_to_2000_tokens():
    short_mean, short_worst = detokenized_per_token(50)
    long_mean, long_worst = detokenized_per_token(2000)
    assert short_worst <= MAX_TOKENS_PER_TOKEN and long_worst <= MAX_TOKENS_PER_TOKEN
    assert long_mean <= short_mean * 1.25, (short_mean, long_mean)  # flat, not growing with the answer
