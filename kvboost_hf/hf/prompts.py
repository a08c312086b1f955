"""Prompts to token ids: what the engine (:class:`~kvboost_hf.engine.InferenceEngine`) and the server's admission
feed the scheduler.

A :class:`PromptEncoder` renders a prompt (a string, segments, chat messages, token ids) to the text the model sees
and tokenizes it once, through a :class:`~kvboost_hf.hf.tokens.SegmentTokenizer` (pieces seen before come from its
cache), with the token offsets where its segments start (each starts a chunk, so a document stored alone hits at
any position). It also knows the model's limits on a request: its context length, end tokens and padding token.

Invariants: the ids of a rendered prompt are exactly the tokenizer's on the whole text; segment starts never change
an id; an empty prompt (or one of zero tokens), a text holding a lone UTF-16 surrogate, chat messages the chat
template refuses and token ids outside the vocabulary raise :class:`~kvboost_hf.core.errors.InputError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.core.errors import CapacityError, ConfigError, InputError
from kvboost_hf.hf.chat_segments import DocumentBoundaries, encode_chat_segments, joined, render_chat
from kvboost_hf.hf.tokens import SegmentTokenizer

Prompt = str | Sequence[str] | Sequence[dict[str, Any]] | Sequence[int]
_PROMPT_FORMS = (
    "a prompt must be a string, a non-empty list of token ids or of segment strings, or a non-empty list of "
    "{'role': ..., 'content': ...} messages"
)
"""A string; a list of strings (segments: documents, a question, each starting a chunk, concatenated as is);
chat messages (``{"role": ..., "content": ...}``) rendered with the tokenizer's chat template, where a content
given as a list of strings is a list of text parts (joined; each part of a two-or-more-part content starts a
segment, see :mod:`kvboost_hf.hf.chat_segments`); or token ids."""


class PromptEncoder:
    """Renders and tokenizes prompts for one model and its tokenizer.

    Args:
        model: the causal LM (its vocabulary size, context length and generation config are read).
        tokenizer: its tokenizer.
        tokens: the prompt token ids cache over ``tokenizer`` (ids identical to the tokenizer's).

    ``max_context`` is the model's context in tokens (``max_position_embeddings``; 0 when the config has none: no
    limit is checked).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tokens: SegmentTokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.max_context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 0))

    def render(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> str:
        """The text the model sees: a string as is, segments concatenated, chat messages (content parts joined)
        through the template, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        items = list(prompt)
        if _token_ids(items):
            return self.tokenizer.decode(items)
        if items and all(isinstance(item, str) for item in items):
            return "".join(str(item) for item in items)
        messages = _chat_messages(items)
        return render_chat(self.tokenizer, joined(messages), add_generation_prompt=add_generation_prompt)

    def encode_segments(
        self,
        prompt: Prompt,
        *,
        add_generation_prompt: bool = True,
        document_boundaries: DocumentBoundaries | str = DocumentBoundaries.PARTS,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the prompt and the token offsets where its segments start (empty for a single text).

        Every text is tokenized once (through :attr:`tokens`: pieces seen before come from its cache).
        Segments are tokenized one by one so each starts a chunk, between the tokenizer's special tokens (e.g. BOS
        first and EOS last, as for the joined text, whichever segments are empty).
        Chat messages are tokenized as one rendered text; ``document_boundaries`` says which contents start
        segments (:func:`~kvboost_hf.hf.chat_segments.encode_chat_segments`: the ids never depend on it).
        Token ids are used as given (each must be in the model's vocabulary).
        """
        if not isinstance(prompt, (str, Sequence)) or isinstance(prompt, (bytes, bytearray)):
            raise InputError(f"{_PROMPT_FORMS}, got {type(prompt).__name__}")
        if not isinstance(prompt, str) and _token_ids(items := list(prompt)):
            self.check_token_ids(items, "token ids")
            return items, []
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special_tokens=True), []
        segments = list(prompt)
        if not segments or not all(isinstance(item, str) for item in segments):
            chat_ids, chat_starts = encode_chat_segments(
                self.tokenizer,
                _chat_messages(segments),
                boundaries=document_boundaries,
                add_generation_prompt=add_generation_prompt,
                tokens=self.tokens,
            )
            if not chat_ids:
                raise InputError("prompt tokenizes to zero tokens")
            return chat_ids, chat_starts
        prefix, suffix = self.tokens.special_tokens()
        ids = list(prefix)
        starts: list[int] = []
        for segment in segments:
            starts.append(len(ids) if starts else 0)  # the first segment's chunk starts with the special prefix
            ids += self.tokenize(str(segment), add_special_tokens=False, allow_empty=True)
        if len(ids) == len(prefix):
            raise InputError("prompt is empty")
        return ids + suffix, starts

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        """Raise InputError naming ``what`` when an id of ``ids`` is outside the model's vocabulary."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if bad := [token for token in ids if not 0 <= token < vocab]:
            raise InputError(f"{what} {bad[:5]} are outside the model's vocabulary of {vocab}")

    def encode(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt; raises on an empty prompt."""
        return self.encode_segments(prompt, add_generation_prompt=add_generation_prompt)[0]

    def tokenize(self, text: str, *, add_special_tokens: bool, allow_empty: bool = False) -> list[int]:
        """Token ids of ``text`` alone (``add_special_tokens``: the tokenizer's, e.g. BOS); an empty text or one of
        zero tokens raises unless ``allow_empty``."""
        if not text and not allow_empty:
            raise InputError("prompt is empty")
        ids = self.tokens.encode(text, add_special_tokens=add_special_tokens) if text else []
        if not ids and not allow_empty:
            raise InputError("prompt tokenizes to zero tokens")
        return ids

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise when ``max_new_tokens`` is not a positive integer (:class:`~kvboost_hf.core.errors.ConfigError`)
        or the prompt and its budget exceed :attr:`max_context` (:class:`~kvboost_hf.core.errors.CapacityError`)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if self.max_context and prompt_tokens + max_new_tokens > self.max_context:
            raise CapacityError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
                f"of {self.max_context} tokens"
            )

    @property
    def pad_token_id(self) -> int:
        """The id used for left padding (the tokenizer's pad token, else its EOS token, else 0)."""
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return int(pad if pad is not None else 0)

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end generation (the model's generation config's, else the tokenizer's)."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}


def _chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """``items`` checked as chat messages (a dict with a role and a content each: a string role, a string content
    or a list of string parts); raises InputError otherwise, naming the first message that is not."""
    if not items or not all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
        raise InputError(_PROMPT_FORMS)
    for index, message in enumerate(items):
        content = message["content"]
        parts = isinstance(content, (list, tuple)) and all(isinstance(part, str) for part in content)
        if not isinstance(message["role"], str) or not (isinstance(content, str) or parts):
            raise InputError(
                f"message {index}: role must be a string and content a string or a list of strings, got role "
                f"{type(message['role']).__name__} and content {type(content).__name__}"
            )
    return items


def _token_ids(items: list[Any]) -> TypeGuard[list[int]]:
    """Whether a prompt given as a list is token ids (every item an int, not a bool)."""
    return bool(items) and all(isinstance(item, int) and not isinstance(item, bool) for item in items)
