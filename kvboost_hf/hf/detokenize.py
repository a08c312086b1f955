"""Incremental detokenization: a growing row's text from a window of its recent tokens, stop strings checked on the
tail that can still complete one.

A tokenizer's ``decode`` of a whole answer at every token costs work that grows with the answer. What
:class:`IncrementalText` decodes per token is a window: the tokens since the last *read offset* (where settled
text ends) plus the few before it from the *prefix offset* on, which give the new tokens their left context (a
sentencepiece tokenizer drops a leading space, a byte-level one splits a character, when a token is decoded alone).
The new text is ``decode(tokens[prefix:])`` minus ``decode(tokens[prefix:read])``. While it ends in U+FFFD (the
replacement character: an incomplete UTF-8 sequence, whose next bytes may come with the next token) nothing
settles and the window grows; the pending text still counts as the row's text. The approach is vLLM's incremental
detokenizer and transformers' ``TextStreamer``.

Work per token: a settled token decodes its window (typically two tokens) and the next prefix window (typically
one); a token that leaves text pending decodes its window only. A run of tokens whose text keeps ending in U+FFFD
(an invalid byte sequence or the character U+FFFD itself) widens the window until a complete character follows.

Invariant (tested against the whole decode, property-based): ``text`` equals ``decode(tokens)`` after every token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


def trailing_replacements(text: str, end: int | None = None) -> int:
    """How many U+FFFD end ``text[:end]`` (read backwards from ``end``, default the end; nothing is copied)."""
    end = len(text) if end is None else end
    start = end
    while start > 0 and text[start - 1] == REPLACEMENT:
        start -= 1
    return end - start


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` (which holds no stop string) may not be shown while the row
    runs: the trailing U+FFFD run (an incomplete character, which may complete a stop string) and the longest end
    of the text before it that starts a stop string. Reads at most ``max(len(stop))`` characters plus the run."""
    pending = trailing_replacements(text)
    settled = len(text) - pending
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, settled), hold, -1):
            if text.startswith(stop[:size], settled - size):
                hold = size
                break
    return pending + hold


def visible_text(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The part of a whole ``text`` that may be shown, and whether a stop string ended it (the reference that
    :class:`IncrementalText` follows token by token).

    With a stop string present the text is cut exactly before its first occurrence. Otherwise a tail that could
    still grow into a stop string, or an incomplete UTF-8 sequence (U+FFFD at the end), is held back.
    """
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if cuts:
        return text[: min(cuts)], True
    return text[: len(text) - held_back(text, stops)], False


class IncrementalText:
    """The text of one row's tokens, updated token by token, with its stop strings.

    Args:
        stops: strings that end the row; its text is cut exactly before the first occurrence of any of them.

    Call :meth:`update` after each token appended to the row's token list. ``text`` is then the whole decoded text
    (pending U+FFFD included), ``stop_at`` the character offset of the first stop string in it (None while there
    is none), and :meth:`visible` what may be shown. ``offsets[i]`` is the length of the text before token ``i``
    without a trailing incomplete character (where token ``i``'s text starts, as OpenAI's ``text_offset``).
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self.longest_stop = max((len(stop) for stop in self.stops), default=0)
        self.prefix_offset = 0  # first token of the decoded window (left context of the new tokens)
        self.read_offset = 0  # tokens before it have settled text
        self._settled = ""  # text of tokens[:read_offset]
        self._prefix_text = ""  # decode(tokens[prefix_offset:read_offset])
        self.text = ""
        self.stop_at: int | None = None
        self.offsets: list[int] = []

    def update(self, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        """Take the tokens appended to ``tokens`` since the last call (``decode``: ids -> text, the same function
        every call); finds a stop string in the new text."""
        searched = len(self._settled)  # text before it held no stop string and cannot change
        self.offsets.append(len(self.text) - trailing_replacements(self.text))
        window = decode(list(tokens[self.prefix_offset :]))
        if len(window) > len(self._prefix_text) and not window.endswith(REPLACEMENT):
            self._settled += window[len(self._prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
            self._prefix_text = decode(list(tokens[self.prefix_offset : self.read_offset]))
            self.text = self._settled
        else:
            self.text = self._settled + window[len(self._prefix_text) :]
        if self.stops and self.stop_at is None:
            start = max(0, searched - self.longest_stop + 1)  # a new occurrence ends after ``searched``
            cuts = [i for i in (self.text.find(stop, start) for stop in self.stops) if i >= 0]
            self.stop_at = min(cuts) if cuts else None

    def visible(self, finished: bool) -> str:
        """What may be shown: cut before the first stop string; else, while running, without a tail that could
        still become one or an incomplete character; else (finished) the whole text."""
        if self.stop_at is not None:
            return self.text[: self.stop_at]
        if finished:
            return self.text
        return self.text[: len(self.text) - held_back(self.text, self.stops)]
