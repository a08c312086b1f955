"""Segment starts of chat messages: where documents begin in a prompt rendered through the chat template.

Non-prefix reuse needs each document to start a chunk (see :func:`~kvboost_hf.core.chunking.chunk_spans`); a
chat prompt is one rendered text, so :func:`encode_chat_segments` finds the token offsets where chosen message
contents (or their content parts) begin and end, without changing a single token id:

1. the prompt is rendered and tokenised once, exactly as ``tokenizer(text, add_special_tokens=False)`` does
   (through a :class:`~kvboost_hf.hf.tokens.SegmentTokenizer` when given: the pieces seen before come from its
   cache, with the same ids and offsets);
2. it is rendered again with every content replaced by a unique sentinel, which locates each content in the text;
   the contents put back between the template's pieces, as they are or trimmed (templates that ``| trim``
   contents), must give the first text again, else (a template that escapes or repeats contents) the prompt gets
   no segments (logged once);
3. each marked character offset becomes the first token that begins at or after it (the fast tokenizer's
   offset mapping). Where the template's text and the content merge into one token (a content starting with a
   newline right after the template's newline, a part ending inside a word that the next part continues), the
   segment starts at the token after the merged one: the ids never change, and the merged token is computed.

Which contents mark documents (:class:`DocumentBoundaries`): ``parts`` (the default) marks every text part of a
message whose content is a list of two or more parts; ``messages`` marks every message's content too; ``none``
marks nothing. Each marked piece contributes its start and its end (so its last partial chunk is exactly its own
tokens, as a document warmed alone stores it). A slow tokenizer (no offset mapping) gives no segments.
"""

from __future__ import annotations

import bisect
import enum
import functools
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from kvboost_hf.core.errors import InputError
from kvboost_hf.hf.tokens import SegmentTokenizer, encode_whole

logger = logging.getLogger(__name__)

ChatMessages = Sequence[Mapping[str, Any]]
"""Chat messages as the template takes them; a ``content`` may also be a list of strings (its text parts)."""


class DocumentBoundaries(str, enum.Enum):
    """Which message contents start segments (documents)."""

    NONE = "none"  # no segments: the prompt is chunked as one text
    PARTS = "parts"  # each text part of a message with two or more parts
    MESSAGES = "messages"  # each message's content, and each part of multi-part contents


#: What the error says when the chat template raised on the messages.
TEMPLATE_REFUSED = "chat template refused the messages"


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: ChatMessages, *, add_generation_prompt: bool, **template_kwargs: Any
) -> str:
    """``messages`` rendered through the chat template (``template_kwargs``: ``tools``, ``chat_template``...); a
    template that raises (jinja's ``raise_exception``: a role it does not take, roles that do not alternate)
    raises :class:`~kvboost_hf.core.errors.InputError` with its message."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except TemplateError as exc:
        raise InputError(f"{TEMPLATE_REFUSED}: {exc}") from exc


def joined(messages: ChatMessages) -> list[dict[str, Any]]:
    """The messages with list contents joined into one string (parts concatenated without separator)."""
    return [{**m, "content": _joined_content(m["content"])} if _parts(m) is not None else dict(m) for m in messages]


def encode_chat_segments(
    tokenizer: PreTrainedTokenizerBase,
    messages: ChatMessages,
    *,
    boundaries: DocumentBoundaries | str = DocumentBoundaries.PARTS,
    add_generation_prompt: bool = True,
    tokens: SegmentTokenizer | None = None,
    **template_kwargs: Any,
) -> tuple[list[int], list[int]]:
    """Token ids of ``messages`` rendered through the chat template, and the token offsets where marked contents
    start and end (strictly increasing, each in ``(0, len(ids))``; empty when nothing is marked or the template's
    text cannot be mapped). ``template_kwargs`` go to ``apply_chat_template`` (``tools``, ``chat_template``...).
    ``tokens``: tokenizes the rendered text (a cache of ``tokenizer``'s ids per piece); None: ``tokenizer`` itself.

    The ids are ``tokenizer(rendered, add_special_tokens=False)["input_ids"]`` of the joined messages, whatever
    ``boundaries`` says; the text is tokenized once. A template that raises on the messages raises InputError.
    """
    boundaries = DocumentBoundaries(boundaries)
    plain = joined(messages)
    text = render_chat(tokenizer, plain, add_generation_prompt=add_generation_prompt, **template_kwargs)
    marked = {i: pieces for i, m in enumerate(messages) if (pieces := _marked_pieces(m, boundaries))}
    if marked and not tokenizer.is_fast:
        _warn_once("a slow tokenizer has no offset mapping: chat prompts get no document boundaries")
    with_starts = bool(marked) and tokenizer.is_fast
    if tokens is None:
        ids, token_starts = encode_whole(tokenizer, text, add_special_tokens=False, with_starts=with_starts)
    else:
        ids, token_starts = tokens.encode_with_starts(text) if with_starts else (tokens.encode(text), None)
    if token_starts is None:
        return ids, []
    placed = _place_contents(tokenizer, plain, text, add_generation_prompt, template_kwargs)
    if placed is None:
        return ids, []
    chars = {placed[i].char(offset) for i, pieces in marked.items() for offset in pieces}
    return ids, _token_offsets(sorted(chars), token_starts, len(ids))


def _parts(message: Mapping[str, Any]) -> list[str] | None:
    """A message's text parts (one for a string content), or None when it has no text content."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, Sequence) and all(isinstance(part, str) for part in content):
        return list(content)
    return None


def _joined_content(content: str | Sequence[str]) -> str:
    return content if isinstance(content, str) else "".join(content)


def _marked_pieces(message: Mapping[str, Any], boundaries: DocumentBoundaries) -> list[int]:
    """Character offsets, from the start of the message's content, of the pieces it marks: each part's start and
    the content's end (empty when ``boundaries`` marks nothing in it)."""
    parts = _parts(message)
    if parts is None or boundaries is DocumentBoundaries.NONE:
        return []
    if boundaries is DocumentBoundaries.PARTS and len(parts) < 2:
        return []
    offsets, position = [], 0
    for part in parts:
        offsets.append(position)
        position += len(part)
    return [*offsets, position]


@dataclass(frozen=True)
class _Placed:
    """Where a message's content lies in the rendered text: from ``start``, ``length`` characters, after the
    template trimmed ``lead`` whitespace characters from its start (0 when it renders contents as they are)."""

    start: int
    length: int
    lead: int

    def char(self, offset: int) -> int:
        """The text offset of the content's character ``offset`` (trimmed characters map to the nearest end)."""
        return self.start + min(max(offset - self.lead, 0), self.length)


def _place_contents(
    tokenizer: PreTrainedTokenizerBase,
    plain: list[dict[str, Any]],
    text: str,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> dict[int, _Placed] | None:
    """Where each string content of ``plain`` (by message index) lies in ``text``, or None when the template does
    not render each content once, as it is or trimmed (``| trim``, as Llama 3's template does)."""
    sentinel = f"\ue000{secrets.token_hex(8)}"
    if any(sentinel in str(m.get("content")) for m in plain):
        return None  # a 64-bit nonce a client guessed
    with_content = [i for i, m in enumerate(plain) if isinstance(m.get("content"), str)]
    probes = [{**m, "content": f"{sentinel}{i}\ue001"} if i in with_content else m for i, m in enumerate(plain)]
    try:
        probed = render_chat(tokenizer, probes, add_generation_prompt=add_generation_prompt, **template_kwargs)
    except InputError:  # the template refuses the sentinels (it took the contents themselves)
        return None
    placed: dict[int, _Placed] = {}
    cursor = position = 0  # in the probed text; in the real text
    for i in with_content:
        marker = f"{sentinel}{i}\ue001"
        found = probed.find(marker, cursor)
        if found < 0 or probed.count(marker) != 1:
            break
        glue, content = probed[cursor:found], plain[i]["content"]
        start = position + len(glue)
        if not text.startswith(glue, position):
            break
        rendered = next((form for form in (content, content.strip()) if text.startswith(form, start)), None)
        if rendered is None:
            break
        lead = 0 if rendered == content else len(content) - len(content.lstrip())
        placed[i] = _Placed(start, len(rendered), lead)
        position, cursor = start + len(rendered), found + len(marker)
    else:
        if text[position:] == probed[cursor:]:
            return placed
    _warn_once("the chat template does not render each content once, as it is or trimmed: no document boundaries")
    return None


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _token_offsets(chars: list[int], token_starts: list[int], length: int) -> list[int]:
    """For each character offset (sorted), the first token beginning at or after it; kept when inside
    ``(0, length)``, duplicates dropped. ``token_starts``: each token's first character (non-decreasing)."""
    starts: list[int] = []
    for char in chars:
        token = bisect.bisect_left(token_starts, char)
        if 0 < token < length and (not starts or token > starts[-1]):
            starts.append(token)
    return starts
