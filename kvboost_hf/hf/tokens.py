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
whole too (cached as one piece). A tokenizer whose added tokens change later is learnt and probed again.

A text without added tokens is one piece: a plain string prompt is reused only when it repeats exactly (a list of
segments is cached per segment, so a document given as its own segment is tokenized once).
"""

from __future__ import annotations

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

from kvboost_hf.core.errors import ConfigError

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


class TokenIdsCache:
    """Token ids per (tokenizer digest, text piece), least recently used out first; at most ``max_bytes`` bytes
    (texts as Python holds them, ids and character starts as 4-byte arrays). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
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

    def put(self, digest: str, text: str, ids: list[int], starts: list[int]) -> None:
        """Store a piece's ids (not when it alone exceeds ``max_bytes``), evicting the least recently used."""
        entry_ids, entry_starts = array("i", ids), array("i", starts)
        nbytes = sys.getsizeof(text) + sys.getsizeof(entry_ids) + sys.getsizeof(entry_starts) + _ENTRY_OVERHEAD
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop((digest, text), None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[(digest, text)] = _Entry(entry_ids, entry_starts, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what makes a tokenizer's ids: its class, its backend's serialized state (vocabulary, merges,
    added tokens with their flags, normalizer, pre-tokenizer, post-processor) and ``split_special_tokens``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    header = f"{type(tokenizer).__qualname__}|{getattr(tokenizer, 'split_special_tokens', False)}|"
    return hashlib.sha256((header + state).encode("utf-8", "surrogatepass")).hexdigest()


def encode_whole(
    tokenizer: PreTrainedTokenizerBase, text: str, *, add_special_tokens: bool, with_starts: bool
) -> tuple[list[int], list[int] | None]:
    """``tokenizer(text)``'s ids and (``with_starts``, fast tokenizers only) each token's first character."""
    if not with_starts or not tokenizer.is_fast:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), None
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]


def _probe_texts(tokenizer: PreTrainedTokenizerBase, specials: list[str]) -> list[str]:
    """Texts that put pieces after, before and between added tokens, with leading spaces, newlines, digits and
    non-ASCII text, and a rendered chat when the tokenizer has a template."""
    bodies = ["user\nHello world", " leading space", "\n\nnewlines  and  spaces\n", "x", "12345 héllo 世界 🙂", "end "]
    marks = specials[:3] or [""]
    texts = ["Hello world", " Hello", "plain text\nwith lines"]
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

    ``segmented`` says whether pieces are cached (the property held on every probe text); ``chars_tokenized``
    counts the characters handed to the tokenizer by this object.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cache: TokenIdsCache | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache = cache
        self.chars_tokenized = 0
        self._special_prefix: list[int] = []
        self._special_suffix: list[int] = []
        self._plain: dict[str, int] = {}  # added tokens matched on the raw text, without strip/word flags
        self._pattern: re.Pattern[str] | None = None
        self.digest = ""
        self.segmented = False
        self._state: tuple[object, ...] = ()
        if cache is not None and cache.max_bytes > 0:
            self._setup()

    def _setup(self) -> None:
        """Learn the tokenizer (digest, split pattern, special tokens) and probe the property; again whenever its
        added tokens or ``split_special_tokens`` change (a new digest: earlier entries are never served)."""
        tokenizer = self.tokenizer
        self._state = self._tokenizer_state()
        self.segmented = False
        if not self._state or getattr(tokenizer, "split_special_tokens", False):
            logger.info("token ids cache off: %s tokenizer", "special-splitting" if self._state else "no fast")
            return
        self.digest = tokenizer_digest(tokenizer)
        self._learn_added_tokens()
        try:
            self.segmented = self._probe()
        except Exception:  # a tokenizer failing on a probe text loses the cache, not the engine
            logger.exception("token ids cache probe failed")
        if not self.segmented:
            logger.warning("this tokenizer's pieces do not tokenize on their own: each prompt is tokenized whole")

    def _tokenizer_state(self) -> tuple[object, ...]:
        """What, changed after construction (``add_tokens``, ``split_special_tokens``), calls for a new setup."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is None:
            return ()
        added = len(backend.get_added_tokens_decoder())
        return (
            added,
            backend.get_vocab_size(with_added_tokens=True),
            getattr(self.tokenizer, "split_special_tokens", False),
        )

    # ------------------------------------------------------------------ public
    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer(text, add_special_tokens=...)["input_ids"]``, unseen pieces only tokenized."""
        if not self._current():
            self.chars_tokenized += len(text)
            return encode_whole(self.tokenizer, text, add_special_tokens=add_special_tokens, with_starts=False)[0]
        ids = self._segmented(text, with_starts=False)[0]
        return self._special_prefix + ids + self._special_suffix if add_special_tokens else ids

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
            "token_cache_segmented": int(self.segmented),
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
            self.chars_tokenized += sum(map(len, unseen))
            backend = self.tokenizer.backend_tokenizer
            if backend.truncation is not None or backend.padding is not None:  # left by an earlier call
                backend.no_truncation()
                backend.no_padding()
            for piece in unseen:  # one by one: a batch would wake the tokenizer's thread pool for a few pieces
                encoding = backend.encode(piece, add_special_tokens=False)
                piece_ids, piece_starts = encoding.ids, [start for start, _ in encoding.offsets]
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

    def _probe(self) -> bool:
        """Whether piece-wise ids and starts equal the whole text's on every probe text, with and without the
        tokenizer's special tokens (whose prefix and suffix are learnt from the first probe)."""
        texts = _probe_texts(self.tokenizer, sorted(self._plain, key=lambda c: self._plain[c]))
        plain_ids, _ = encode_whole(self.tokenizer, texts[0], add_special_tokens=False, with_starts=False)
        special_ids, _ = encode_whole(self.tokenizer, texts[0], add_special_tokens=True, with_starts=False)
        at = next((i for i in range(len(special_ids) + 1) if special_ids[i : i + len(plain_ids)] == plain_ids), None)
        if not plain_ids or at is None:
            return False
        self._special_prefix, self._special_suffix = special_ids[:at], special_ids[at + len(plain_ids) :]
        probe_cache, self.cache = self.cache, TokenIdsCache(1 << 20)
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
            self.chars_tokenized = 0
