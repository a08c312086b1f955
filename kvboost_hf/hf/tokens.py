"""Prompt text -> token ids, tokenizing each text segment once: exact ids cached per segment.

A fast tokenizer (``tokenizers``) first splits its input on the added tokens that match the raw text (those with
``normalized=False``, chosen leftmost-longest), then normalizes, pre-tokenizes and tokenizes each piece on its
own. So in a rendered chat prompt the text between two special tokens (a message's role and content) tokenizes
independently of the rest, and the ids of a conversation's earlier messages can be reused when it grows.

:class:`SegmentTokenizer` splits a text the same way, looks every piece up in a :class:`TokenIdsCache` (least
recently used out first, bounded in bytes, keyed by the tokenizer's digest and the piece's text, so tokenizers
never share entries), hands only the unseen pieces to the tokenizer and concatenates.

Invariant: the ids (and each token's first character) equal ``tokenizer(text, add_special_tokens=...)`` of the
whole text. The property depends on the tokenizer (a sentencepiece-style ``Metaspace`` pre-tokenizer with
``prepend_scheme="first"`` prepends ``"▁"`` to a piece that starts the text, so a piece tokenized alone differs
from the same piece inside the prompt), so it is checked on probe texts when a :class:`SegmentTokenizer` is
built; where it fails (or the tokenizer is slow, splits special tokens, or caching is off) every text is
tokenized whole, once. A text holding an added token with ``lstrip``/``rstrip``/``single_word`` is tokenized
whole too (cached as one piece). A tokenizer whose added tokens, or the special tokens it adds around a text
(``add_bos_token``, ``add_eos_token``, its post-processor), change later is learnt and probed again.

A text without added tokens is one piece. A piece not seen before but starting with one seen before (a document
followed by another question, a long system prompt followed by other text in one string) continues that piece's
ids: the cache indexes every piece of at least :data:`CONTINUATION_MIN_CHARS` characters by its first
:data:`HEAD_CHARS`, finds the one sharing the longest prefix with the new piece, keeps its tokens up to the last one
that starts right after a newline at least :data:`CUT_MARGIN_CHARS` before the texts part, and tokenizes only the
rest. Exact where a newline ends a pre-token whatever follows it (byte-level BPE with the usual split regexes does:
a token never spans a newline and the next word), which is probed too (every cut of that kind in multi-line probe
texts must give the whole text's ids); where it fails the piece is tokenized whole.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvboost_hf.core.errors import ConfigError, InputError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenCacheConfig:
    """The token ids cache of an engine's prompts (:class:`TokenIdsCache`).

    Attributes:
        max_bytes: bytes of cached piece texts and ids, least recently used out first (0: no cache)
    """

    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 0:
            raise ConfigError(f"token cache max_bytes must be a non-negative integer, got {self.max_bytes!r}")


@dataclass(frozen=True)
class _Entry:
    """One piece's ids and each token's first character (from the piece's start)."""

    ids: array
    starts: array
    nbytes: int


_ENTRY_OVERHEAD = 200  # bytes of the key tuple, the entry object and the dict slot, roughly

#: Characters a piece needs to be continued by a later piece (indexed by its head), and that a continuation must keep
#: from it: below this, tokenizing the piece again costs less than finding it.
CONTINUATION_MIN_CHARS = 1024

#: Characters of a piece's head, the key a later piece starting with the same text finds it by.
HEAD_CHARS = 256

#: Characters a continuation's cut stays before the end of the text the two pieces share, so that whatever a
#: pre-tokenizer looks at past a boundary (a character of lookahead, a run of newlines) is the same in both.
CUT_MARGIN_CHARS = 16

#: Cached pieces sharing a head that a new piece is compared with (the most recently used first).
CONTINUATION_CANDIDATES = 4

#: Tokens a continuation walks back from the end of the shared text to find one starting right after a newline.
CUT_SEARCH_TOKENS = 4096


class TokenIdsCache:
    """Token ids per (tokenizer digest, text piece), least recently used out first; at most ``max_bytes`` bytes
    (texts as Python holds them, ids and character starts as 4-byte arrays, head keys). Pieces of at least
    :data:`CONTINUATION_MIN_CHARS` characters are also indexed by their first :data:`HEAD_CHARS` characters
    (:meth:`longest_prefix`). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._heads: dict[tuple[str, str], OrderedDict[str, None]] = {}  # (digest, head) -> pieces, newest last
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, digest: str, text: str) -> _Entry | None:
        with self._lock:
            entry = self._entries.get((digest, text))
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end((digest, text))
            self.hits += 1
            return entry

    def longest_prefix(self, digest: str, text: str) -> tuple[str, _Entry, int] | None:
        """The cached piece (of tokenizer ``digest``, at least :data:`CONTINUATION_MIN_CHARS` long, other than
        ``text``) sharing the longest prefix with ``text`` among the :data:`CONTINUATION_CANDIDATES` most recently
        used with its head: ``(piece, entry, characters shared)``, or None (none shares a head with it)."""
        if len(text) < CONTINUATION_MIN_CHARS:
            return None
        with self._lock:
            pieces = self._heads.get((digest, text[:HEAD_CHARS]))
            if not pieces:
                return None
            candidates = [piece for piece in reversed(pieces) if piece != text][:CONTINUATION_CANDIDATES]
            if not candidates:
                return None
            shared, best = max((common_prefix_length(piece, text), piece) for piece in candidates)
            self._entries.move_to_end((digest, best))
            return best, self._entries[(digest, best)], shared

    def put(self, digest: str, text: str, ids: list[int], starts: list[int]) -> None:
        """Store a piece's ids (not when it alone exceeds ``max_bytes``), evicting the least recently used."""
        entry_ids, entry_starts = array("i", ids), array("i", starts)
        nbytes = sys.getsizeof(text) + sys.getsizeof(entry_ids) + sys.getsizeof(entry_starts) + _ENTRY_OVERHEAD
        indexed = len(text) >= CONTINUATION_MIN_CHARS
        nbytes += sys.getsizeof(text[:HEAD_CHARS]) if indexed else 0
        if nbytes > self.max_bytes:
            return
        with self._lock:
            self._drop((digest, text))
            self._entries[(digest, text)] = _Entry(entry_ids, entry_starts, nbytes)
            if indexed:
                self._heads.setdefault((digest, text[:HEAD_CHARS]), OrderedDict())[text] = None
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def _drop(self, key: tuple[str, str]) -> None:
        """Forget the entry of ``key`` (with its head index), if cached (called with the lock held)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry.nbytes
        digest, text = key
        pieces = self._heads.get((digest, text[:HEAD_CHARS]))
        if pieces is not None:
            pieces.pop(text, None)
            if not pieces:
                del self._heads[(digest, text[:HEAD_CHARS])]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._heads.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def common_prefix_length(first: str, second: str) -> int:
    """Characters ``first`` and ``second`` share from their start (a binary search over C-level comparisons)."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if second.startswith(first[low:middle], low):
            low = middle
        else:
            high = middle - 1
    return low


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what makes a tokenizer's ids: its class, its backend's serialized state (vocabulary, merges,
    added tokens with their flags, normalizer, pre-tokenizer, post-processor) and ``split_special_tokens``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    header = f"{type(tokenizer).__qualname__}|{getattr(tokenizer, 'split_special_tokens', False)}|"
    return hashlib.sha256((header + state).encode("utf-8", "surrogatepass")).hexdigest()


def check_encodable(text: str) -> None:
    """Raise InputError when ``text`` holds a lone UTF-16 surrogate (U+D800 to U+DFFF, which has no UTF-8 form: a
    tokenizer refuses the text with a TypeError). Linear in ``len(text)``, done where a text is tokenized."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = ord(text[exc.start])
        raise InputError(f"prompt holds a lone UTF-16 surrogate (U+{surrogate:04X}), which no tokenizer takes") from exc


def encode_whole(
    tokenizer: PreTrainedTokenizerBase, text: str, *, add_special_tokens: bool, with_starts: bool
) -> tuple[list[int], list[int] | None]:
    """``tokenizer(text)``'s ids and (``with_starts``, fast tokenizers only) each token's first character; a lone
    surrogate in ``text`` raises InputError (:func:`check_encodable`)."""
    check_encodable(text)
    if not with_starts or not tokenizer.is_fast:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), None
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]


#: The text whose ids with and without the tokenizer's special tokens show the ids those add before and after a text.
SPECIAL_TOKENS_PROBE_TEXT = "Hello world"


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]] | None:
    """The ids ``tokenizer(text)`` (``add_special_tokens=True``) puts before and after a text's own ids (Llama 2:
    ``([bos], [])``), learnt on :data:`SPECIAL_TOKENS_PROBE_TEXT`; None where its own ids are not found in one run
    among them (a post-processor that changes them)."""
    text = SPECIAL_TOKENS_PROBE_TEXT
    plain_ids, _ = encode_whole(tokenizer, text, add_special_tokens=False, with_starts=False)
    special_ids, _ = encode_whole(tokenizer, text, add_special_tokens=True, with_starts=False)
    at = next((i for i in range(len(special_ids) + 1) if special_ids[i : i + len(plain_ids)] == plain_ids), None)
    if not plain_ids or at is None:
        return None
    return special_ids[:at], special_ids[at + len(plain_ids) :]


#: Multi-line probe texts of a continuation's cut (:meth:`SegmentTokenizer._probe_continuation`): every line start
#: a pre-tokenizer might treat differently (indentation, tabs, punctuation and digits either side of a newline,
#: blank lines, ``\r\n``, non-ASCII and characters split over several byte-level tokens).
CUT_PROBE_TEXT = (
    "Chapter 1. The start\nPlain words follow.\n  indented two\n\tTabbed line\n\n\nAfter blank lines\n"
    "ends with a colon:\n- a list item\n* another\n# A heading\n1. numbered\n2024 was a year\n"
    "trailing spaces   \nnext line\r\nwindows line\n'quoted' line\n\"double\" quotes\n(paren) line)\n"
    "东京 and 大阪\n🙂 emoji first\n🙂🙂\nhéllo wörld\n    def f(x):\n        return x + 1\n"
    "}\n{\n\n  \n \nend.\n.\n...\n\n"
)


def _probe_texts(tokenizer: PreTrainedTokenizerBase, specials: list[str]) -> list[str]:
    """Texts that put pieces after, before and between added tokens, with leading spaces, newlines, digits and
    non-ASCII text, and a rendered chat when the tokenizer has a template."""
    bodies = ["user\nHello world", " leading space", "\n\nnewlines  and  spaces\n", "x", "12345 héllo 世界 🙂", "end "]
    marks = specials[:3] or [""]
    texts = [SPECIAL_TOKENS_PROBE_TEXT, " Hello", "plain text\nwith lines"]
    for mark in marks:
        texts.append(mark + mark.join(bodies) + mark)
        texts.append(bodies[0] + mark + bodies[1])
        texts.append(" " + mark + "\n" + mark + " tail")
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": " Where is Paris?\n"},
            {"role": "assistant", "content": "In France."},
            {"role": "user", "content": "And 東京?"},
        ]
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        except Exception as exc:  # a template refusing a role only loses one probe
            logger.debug("chat template probe skipped: %s", exc)
    return texts


class SegmentTokenizer:
    """Token ids of prompt texts, each special-token-delimited piece tokenized once per cache lifetime.

    Args:
        tokenizer: the Hugging Face tokenizer whose ids are reproduced exactly.
        cache: the piece cache (may be shared by several tokenizers: entries are keyed by :func:`tokenizer_digest`);
            None or ``max_bytes == 0`` tokenizes every text whole.

    ``segmented`` says whether pieces are cached (the property held on every probe text); ``continues`` whether a
    new piece may continue the ids of a cached one it starts with (the newline cut held on every probe text);
    ``chars_tokenized`` counts the characters handed to the tokenizer by this object, ``prefix_hits`` the pieces
    continued.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cache: TokenIdsCache | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache = cache
        self.chars_tokenized = 0
        self.prefix_hits = 0
        self._special_prefix: list[int] = []
        self._special_suffix: list[int] = []
        self._plain: dict[str, int] = {}  # added tokens matched on the raw text, without strip/word flags
        self._pattern: re.Pattern[str] | None = None
        self.digest = ""
        self.segmented = False
        self.continues = False
        self._state: tuple[object, ...] = ()
        if cache is not None and cache.max_bytes > 0:
            self._setup()

    def _setup(self) -> None:
        """Learn the tokenizer (digest, split pattern, special tokens) and probe the property; again whenever its
        added tokens, ``split_special_tokens`` or the special tokens it adds change (a new digest: earlier entries
        are never served)."""
        tokenizer = self.tokenizer
        self._state = self._tokenizer_state()
        self.segmented = self.continues = False
        if not self._state or getattr(tokenizer, "split_special_tokens", False):
            logger.info("token ids cache off: %s tokenizer", "special-splitting" if self._state else "no fast")
            return
        self.digest = tokenizer_digest(tokenizer)
        self._learn_added_tokens()
        try:
            self.segmented = self._probe()
            self.continues = self.segmented and self._probe_continuation()
        except Exception:  # a tokenizer failing on a probe text loses the cache, not the engine
            logger.exception("token ids cache probe failed")
        if not self.segmented:
            logger.warning("this tokenizer's pieces do not tokenize on their own: each prompt is tokenized whole")
        elif not self.continues:
            logger.info("this tokenizer does not restart after a newline: a new piece is tokenized whole")

    def _tokenizer_state(self) -> tuple[object, ...]:
        """What, changed after construction (``add_tokens``, ``split_special_tokens``, ``add_bos_token`` and
        ``add_eos_token``, the post-processor that adds special tokens), calls for a new setup. Checked per call:
        the post-processor's serialized form is a few hundred bytes (under a microsecond)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is None:
            return ()
        added = len(backend.get_added_tokens_decoder())
        post_processor = backend.post_processor
        return (
            added,
            backend.get_vocab_size(with_added_tokens=True),
            getattr(self.tokenizer, "split_special_tokens", False),
            getattr(self.tokenizer, "add_bos_token", None),
            getattr(self.tokenizer, "add_eos_token", None),
            post_processor.__getstate__() if post_processor is not None else None,
        )

    # ------------------------------------------------------------------ public
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer(text, add_special_tokens=...)["input_ids"]``, unseen pieces only tokenized; a lone UTF-16
        surrogate raises InputError."""
        if not self._current():
            self.chars_tokenized += len(text)
            return encode_whole(self.tokenizer, text, add_special_tokens=add_special_tokens, with_starts=False)[0]
        ids = self._segmented(text, with_starts=False)[0]
        return self._special_prefix + ids + self._special_suffix if add_special_tokens else ids

    def special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens=True`` puts before and after a text's own (e.g. ``([bos], [])``); where they
        cannot be told apart (see :func:`special_tokens_around`), all of an empty text's, before it."""
        if self._current():
            return list(self._special_prefix), list(self._special_suffix)
        around = special_tokens_around(self.tokenizer)
        if around is None:
            return encode_whole(self.tokenizer, "", add_special_tokens=True, with_starts=False)[0], []
        return around

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int] | None]:
        """Ids (no special tokens added) and each token's first character in ``text`` (the offset mapping's
        starts; None for a slow tokenizer)."""
        if not self._current():
            self.chars_tokenized += len(text)
            return encode_whole(self.tokenizer, text, add_special_tokens=False, with_starts=True)
        return self._segmented(text, with_starts=True)

    def stats(self) -> dict[str, int]:
        """``token_cache_*`` counters: hits and misses (pieces), entries, bytes, evictions, characters handed to
        the tokenizer, and whether pieces are cached at all (``token_cache_segmented``, 0 or 1)."""
        cache = self.cache
        return {
            "token_cache_hits": cache.hits if cache else 0,
            "token_cache_misses": cache.misses if cache else 0,
            "token_cache_entries": len(cache) if cache else 0,
            "token_cache_bytes": cache.bytes if cache else 0,
            "token_cache_evictions": cache.evictions if cache else 0,
            "token_cache_chars_tokenized": self.chars_tokenized,
            "token_cache_prefix_hits": self.prefix_hits,
            "token_cache_segmented": int(self.segmented),
            "token_cache_continues": int(self.continues),
        }

    def clear(self) -> None:
        """Forget every cached piece (those of other tokenizers sharing the cache too); counters are kept."""
        if self.cache is not None:
            self.cache.clear()

    # ------------------------------------------------------------------ internals
    def _current(self) -> bool:
        """Whether pieces are cached, after a new setup if the tokenizer changed since the last one."""
        if self._state and self._tokenizer_state() != self._state:
            logger.info("the tokenizer changed: token ids cache set up again")
            self._setup()
        return self.segmented

    def _learn_added_tokens(self) -> None:
        """The split pattern: every added token matched on the raw text, longest first at a position (the
        tokenizer's leftmost-longest matching); those without strip or word flags map straight to their id."""
        raw = [t for t in self.tokenizer.backend_tokenizer.get_added_tokens_decoder().items() if not t[1].normalized]
        contents = sorted({token.content for _, token in raw if token.content}, key=len, reverse=True)
        self._plain = {
            token.content: index
            for index, token in raw
            if token.content and not (token.lstrip or token.rstrip or token.single_word)
        }
        self._pattern = re.compile("|".join(map(re.escape, contents))) if contents else None

    def _pieces(self, text: str) -> list[tuple[int, str]] | None:
        """``(start, piece)`` in order, added tokens as pieces of their own; None when a flagged added token (whose
        match eats spaces or depends on word boundaries) occurs."""
        if self._pattern is None:
            return [(0, text)]
        pieces: list[tuple[int, str]] = []
        cursor = 0
        for match in self._pattern.finditer(text):
            if match.group() not in self._plain:
                return None
            if match.start() > cursor:
                pieces.append((cursor, text[cursor : match.start()]))
            pieces.append((match.start(), match.group()))
            cursor = match.end()
        if cursor < len(text):
            pieces.append((cursor, text[cursor:]))
        return pieces

    def _segmented(self, text: str, *, with_starts: bool) -> tuple[list[int], list[int]]:
        """Ids and (``with_starts``, else empty) character starts of ``text``, no special tokens added, from cached
        pieces; the unseen ones are tokenized and cached."""
        assert self.cache is not None
        pieces = self._pieces(text) or [(0, text)]
        found: dict[str, tuple[Any, Any]] = {}
        unseen: list[str] = []
        for _, piece in pieces:
            if piece in self._plain or piece in found:
                continue
            entry = self.cache.get(self.digest, piece)
            if entry is None:
                if piece not in unseen:
                    unseen.append(piece)
            else:
                found[piece] = (entry.ids, entry.starts)
        if unseen:
            backend = self._backend()
            for piece in unseen:  # one by one: a batch would wake the tokenizer's thread pool for a few pieces
                check_encodable(piece)
                kept, kept_starts, cut = self._continuation(piece)
                encoding = backend.encode(piece[cut:], add_special_tokens=False)
                self.chars_tokenized += len(piece) - cut
                piece_ids = kept + encoding.ids
                piece_starts = kept_starts + [start + cut for start, _ in encoding.offsets]
                self.cache.put(self.digest, piece, piece_ids, piece_starts)
                found[piece] = (piece_ids, piece_starts)
        ids: list[int] = []
        starts: list[int] = []
        for offset, piece in pieces:
            if piece in self._plain:
                ids.append(self._plain[piece])
                starts.append(offset)
                continue
            piece_ids, piece_starts = found[piece]
            ids.extend(piece_ids)
            if with_starts:
                starts.extend(start + offset for start in piece_starts)
        return ids, starts

    def _backend(self) -> Any:
        """The tokenizer's backend set as ``tokenizer(text)`` sets it per call: no truncation or padding, special
        tokens split only with ``split_special_tokens`` (an earlier call with other arguments leaves its own)."""
        backend = self.tokenizer.backend_tokenizer
        if backend.truncation is not None or backend.padding is not None:
            backend.no_truncation()
            backend.no_padding()
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        return backend

    def _continuation(self, piece: str) -> tuple[list[int], list[int], int]:
        """What ``piece`` keeps of the cached piece sharing its longest prefix: that piece's ids and starts before
        its last token that starts right after a newline, at least :data:`CUT_MARGIN_CHARS` before the texts part
        and at least :data:`CONTINUATION_MIN_CHARS` in, and that token's start (where tokenizing resumes);
        ``([], [], 0)`` when nothing is kept (continuation off, no such piece or token)."""
        found = self.cache.longest_prefix(self.digest, piece) if self.continues and self.cache is not None else None
        if found is None:
            return [], [], 0
        text, entry, shared = found
        last = bisect.bisect_right(entry.starts, shared - CUT_MARGIN_CHARS) - 1
        for index in range(last, max(last - CUT_SEARCH_TOKENS, 0), -1):
            start = entry.starts[index]
            if start < CONTINUATION_MIN_CHARS:
                break
            if text[start - 1] == "\n" and entry.starts[index - 1] < start:  # its char's first token
                self.prefix_hits += 1
                return entry.ids[:index].tolist(), entry.starts[:index].tolist(), start
        return [], [], 0

    def _probe_continuation(self) -> bool:
        """Whether tokenizing may resume at a token that starts right after a newline (the first token of its
        character): on :data:`CUT_PROBE_TEXT` (and it followed by a question), the ids before every such token and
        the ids of the text from it equal the whole text's, and so do the starts."""
        backend = self._backend()
        for text in (CUT_PROBE_TEXT, CUT_PROBE_TEXT + "What is the first line about?"):
            encoding = backend.encode(text, add_special_tokens=False)
            ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
            for index, start in enumerate(starts):
                if index == 0 or text[start - 1] != "\n" or starts[index - 1] >= start:
                    continue
                tail = backend.encode(text[start:], add_special_tokens=False)
                if ids[:index] + tail.ids != ids or starts[index:] != [start + s for s, _ in tail.offsets]:
                    logger.info("token ids cache: tokenizing does not restart at character %d of the probe", start)
                    return False
        return True

    def _probe(self) -> bool:
        """Whether piece-wise ids and starts equal the whole text's on every probe text, with and without the
        tokenizer's special tokens (whose prefix and suffix :func:`special_tokens_around` learns)."""
        around = special_tokens_around(self.tokenizer)
        if around is None:
            return False
        self._special_prefix, self._special_suffix = around
        texts = _probe_texts(self.tokenizer, sorted(self._plain, key=lambda c: self._plain[c]))
        probe_cache, self.cache = self.cache, TokenIdsCache(1 << 20)
        counted = self.chars_tokenized  # the prompts' count: the probe's own tokenizing is not added
        try:
            for text in texts:
                for special in (False, True):
                    expected = encode_whole(self.tokenizer, text, add_special_tokens=special, with_starts=True)
                    ids, starts = self._segmented(text, with_starts=True)
                    if special:
                        ids = self._special_prefix + ids + self._special_suffix
                    if ids != expected[0] or (not special and starts != expected[1]):
                        logger.info("token ids cache probe differs on %r (special tokens: %s)", text[:60], special)
                        return False
            return True
        finally:
            self.cache = probe_cache
            self.chars_tokenized = counted
