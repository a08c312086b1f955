"""The prompt token ids cache (kvboost_hf.hf.tokens): ids and offsets equal the tokenizer's own on the whole text,
for the embedded tokenizer and for sentencepiece-style tokenizers built here with ``tokenizers``; a tokenizer whose
pieces do not tokenize on their own falls back to whole texts; a new piece continues the ids of a cached one it
starts with (a document followed by another question) where the tokenizer restarts after a newline, and is
tokenized whole where it does not; a warm chat request tokenizes only its new messages and a warm document request
only its new question (counted at the tokenizer's backend); the cache stays within its bytes and counts what it
does. The oracle is the
tokenizer itself called on the whole text."""

from __future__ import annotations

import copy
import functools

import pytest
from conftest import make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvboost_hf.bench.profiling import CharacterCounter
from kvboost_hf.core.errors import InputError
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.chat_segments import encode_chat_segments
from kvboost_hf.hf.models import embedded_model_dir
from kvboost_hf.hf.prompts import PromptEncoder
from kvboost_hf.hf.tokens import (
    CONTINUATION_MIN_CHARS,
    SegmentTokenizer,
    TokenCacheConfig,
    TokenIdsCache,
    tokenizer_digest,
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
FRAGMENTS = [
    "Hello",
    " world",
    "\n",
    "  ",
    "\n\n",
    "\t",
    "don't",
    "123",
    "é",
    "世界",
    "🙂",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<s>",
    "<mask>",  # an added token with lstrip (sentencepiece-style tokenizers): its texts are tokenized whole
    "foo bar",  # a normalized added token (sentencepiece-style tokenizers)
]


@functools.cache
def embedded_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@functools.cache
def sentencepiece_style(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A BPE tokenizer with sentencepiece's ``Metaspace`` pre-tokenizer (``▁`` for spaces, prepended per
    ``prepend_scheme``), a ``<s>`` prefix as special tokens, ChatML specials, an added token with ``lstrip`` and a
    normalized added token; trained here on a few sentences."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    corpus = ["hello world, this is a small test of a sentencepiece style tokenizer", "the user asked 123 questions"]
    backend.train_from_iterator(corpus * 10, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    backend.add_tokens([AddedToken("foo bar", normalized=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHATML
    return tokenizer


def oracle(tokenizer: PreTrainedTokenizerFast, text: str) -> tuple[list[int], list[int]]:
    """The tokenizer's own ids and token starts for the whole text (no special tokens added)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]


@functools.cache
def segment_tokenizer(name: str) -> SegmentTokenizer:
    """One cached SegmentTokenizer per tokenizer for the module (entries carry over between examples)."""
    tokenizer = embedded_tokenizer() if name == "embedded" else sentencepiece_style(name)
    return SegmentTokenizer(tokenizer, TokenIdsCache(4 << 20))


contents = st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=10).map("".join), st.text(max_size=24))
histories = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), contents), min_size=1, max_size=6)


@pytest.mark.parametrize("name", ["embedded", "always", "first"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories)
def test_segment_cached_ids_equal_the_whole_prompts_ids_over_growing_chats(name, history):
    tokens = segment_tokenizer(name)
    tokenizer = tokens.tokenizer
    messages = [{"role": role, "content": content} for role, content in history]
    for turn in range(1, len(messages) + 1):  # the conversation growing: earlier pieces come from the cache
        text = tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
        assert tokens.encode_with_starts(text) == oracle(tokenizer, text)
        assert tokens.encode(text, add_special_tokens=True) == tokenizer(text)["input_ids"]
    for boundaries in ("messages", "parts"):
        expected = encode_chat_segments(tokenizer, messages, boundaries=boundaries)
        assert encode_chat_segments(tokenizer, messages, boundaries=boundaries, tokens=tokens) == expected


def test_the_probe_keeps_pieces_where_they_tokenize_alone_and_falls_back_where_they_do_not():
    assert segment_tokenizer("embedded").segmented and segment_tokenizer("always").segmented
    first = sentencepiece_style("first")
    backend = first.backend_tokenizer
    # the property fails for this tokenizer: "user" alone gets the "▁" prepended that it does not get in the prompt
    alone = backend.encode("<|im_start|>", add_special_tokens=False).ids + backend.encode("user").ids
    assert alone != first("<|im_start|>user", add_special_tokens=False)["input_ids"]
    tokens = SegmentTokenizer(first, TokenIdsCache(1 << 20))
    assert not tokens.segmented
    text = first.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False)
    assert tokens.encode_with_starts(text) == oracle(first, text)
    assert tokens.stats()["token_cache_segmented"] == 0 and tokens.stats()["token_cache_chars_tokenized"] == len(text)
    off = SegmentTokenizer(embedded_tokenizer(), TokenIdsCache(TokenCacheConfig(max_bytes=0).max_bytes))
    assert not off.segmented and off.encode(text) == embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]


HEADER = "".join(f"Manual line {index:03d}: read it.\n" for index in range(60))  # 1,560 characters, 60 lines
lines = st.one_of(
    st.lists(st.sampled_from([*FRAGMENTS[:11], " ", ".", ":", "-", "\r", "    "]), max_size=8).map("".join),
    st.text(max_size=30),
)


@functools.cache
def continuing_tokenizer(name: str) -> SegmentTokenizer:
    """A SegmentTokenizer of its own per tokenizer (its cache cleared by each example)."""
    return SegmentTokenizer(segment_tokenizer(name).tokenizer, TokenIdsCache(4 << 20))


@pytest.mark.parametrize("name", ["embedded", "always"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.lists(lines, max_size=40).map("\n".join), questions=st.lists(contents, min_size=2, max_size=4))
def test_a_piece_continuing_a_cached_one_has_the_whole_texts_ids(name, body, questions):
    """A long multi-line document (a fixed header, then random lines) followed by different questions: every
    prompt's ids and starts equal the tokenizer's own on the whole text. The embedded (byte-level) tokenizer
    continues each later prompt from the earlier one; the sentencepiece-style one, whose pre-tokenizer does not
    restart after a newline, is probed off and tokenizes each whole."""
    assert len(HEADER) > CONTINUATION_MIN_CHARS
    tokens = continuing_tokenizer(name)
    tokens.clear()  # each example from an empty cache (the probe ran once, when it was built)
    assert tokens.continues == (name == "embedded")
    for index, question in enumerate(questions):
        text = HEADER + body + question
        hits = tokens.prefix_hits
        # one piece (no added token splits it) not cached yet, after a prompt whose first piece starts with HEADER
        new_piece = tokens._pieces(text) == [(0, text)] and (tokens.digest, text) not in tokens.cache._entries
        assert tokens.encode_with_starts(text) == oracle(tokens.tokenizer, text)
        continued = tokens.prefix_hits > hits
        if name != "embedded":
            assert not continued
        elif new_piece and index > 0:
            assert continued


def test_a_continuation_never_cuts_inside_a_line():
    """The shared text ends inside a 612-character word (no space, no newline). Tokenizing is only resumed where the
    probe showed the tokenizer restarts (right after a newline), never inside a line whose pre-token could span the
    cut: each continuation tokenizes the whole word again, from its line's start."""
    tokens = SegmentTokenizer(embedded_tokenizer(), TokenIdsCache(4 << 20))
    word = "Supercalifragilisticexpialidocious" * 18
    for question in ("? first", "? second", "! third"):
        text = HEADER + word + question
        assert tokens.encode_with_starts(text) == oracle(tokens.tokenizer, text)
    assert tokens.prefix_hits == 2
    assert len(HEADER + word) + 2 * len(word) < tokens.chars_tokenized < len(HEADER + word) + 2 * (len(word) + 40)


def test_a_warm_document_request_tokenizes_its_question_and_the_documents_last_line_only():
    """A RAG-style plain prompt (a document, then a question) asked again with another question: the engine's
    token ids cache keeps the document's ids up to its last line and tokenizes the rest; the ids equal the
    tokenizer's and the request reuses the document's K/V."""
    engine, tokenizer = tiny_engine(), embedded_tokenizer()
    document = "".join(f"Fact {index}: the store keeps chunk {index} for later.\n" for index in range(40))
    last_line = document.splitlines(keepends=True)[-1]
    engine.generate(document + "Question: which chunk comes first?", max_new_tokens=2)
    question = "Question: which chunk is the last one?"
    prompt = document + question
    hits = engine.cache_stats()["token_cache_prefix_hits"]
    with CharacterCounter(tokenizer) as counter:
        second = engine.generate(prompt, max_new_tokens=2)
    assert second.prompt_tokens == len(oracle(tokenizer, prompt)[0]) and second.cached_tokens > 0
    assert engine.encode(prompt) == tokenizer(prompt)["input_ids"]
    assert 0 < counter.chars <= len(last_line) + len(question) < len(prompt) // 10
    assert engine.cache_stats()["token_cache_prefix_hits"] > hits


def test_evicted_pieces_are_never_continued():
    cache = TokenIdsCache(CONTINUATION_MIN_CHARS * 12)
    tokens = SegmentTokenizer(embedded_tokenizer(), cache)
    documents = [f"Doc {index}\n" + HEADER for index in range(8)]  # each about 1.6 KB: the cache holds a few
    for document in documents:
        tokens.encode(document + "first question")
    assert cache.evictions > 0
    for document in documents:
        found = cache.longest_prefix(tokens.digest, document + "second question")
        assert (found is None) == ((tokens.digest, document + "first question") not in cache._entries)
    cache.clear()
    assert cache.longest_prefix(tokens.digest, documents[-1] + "again") is None


def test_tokenizers_never_share_entries():
    embedded, spm = embedded_tokenizer(), sentencepiece_style("always")
    assert tokenizer_digest(embedded) != tokenizer_digest(spm) == tokenizer_digest(sentencepiece_style("always"))
    shared = TokenIdsCache(1 << 20)
    first, second = SegmentTokenizer(embedded, shared), SegmentTokenizer(spm, shared)
    text = "<|im_start|>user\nhello world<|im_end|>\n"
    assert first.encode(text) == embedded(text, add_special_tokens=False)["input_ids"]
    assert second.encode(text) == spm(text, add_special_tokens=False)["input_ids"]
    assert shared.hits == 0 and len(shared) == 4  # "user\nhello world" and "\n" for each tokenizer


def test_a_token_added_after_construction_sets_the_cache_up_again():
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())  # a copy of its own: it is changed
    tokens = SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20))
    text = "<|im_start|>user\nmy zorblax token<|im_end|>\n"
    assert tokens.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    digest = tokens.digest
    counted = tokens.stats()["token_cache_chars_tokenized"]
    tokenizer.add_tokens([AddedToken("zorblax", normalized=False)])
    assert tokens.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokens.digest != digest and tokens.segmented
    pieces = len("user\nmy ") + len(" token") + len("\n")  # a new digest: each piece is tokenized again
    assert tokens.stats()["token_cache_chars_tokenized"] == counted + pieces  # the counter is kept


def test_special_tokens_changed_after_construction_are_the_ones_added():
    """``add_bos_token``/``add_eos_token`` set later (transformers rebuilds the post-processor) and a post-processor
    replaced at the backend: ``encode(add_special_tokens=True)`` and the segment prompts' special tokens follow."""
    tokenizer = copy.deepcopy(sentencepiece_style("always"))
    tokens = SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20))
    text = "<|im_start|>user\nhello world<|im_end|>\n"
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def change_post_processor() -> None:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="</s> $A <s>", special_tokens=[("<s>", bos), ("</s>", eos)]
        )

    changes = [
        lambda: setattr(tokenizer, "add_eos_token", True),
        lambda: setattr(tokenizer, "add_bos_token", True),
        lambda: setattr(tokenizer, "add_bos_token", False),
        change_post_processor,
    ]
    for change in changes:
        change()
        expected = tokenizer(text)["input_ids"]
        assert tokens.encode(text, add_special_tokens=True) == expected
        prefix, suffix = tokens.special_tokens()
        assert prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + suffix == expected
    assert tokens.segmented and expected[0] == eos and expected[-1] == bos


def test_a_call_that_split_special_tokens_leaves_the_ids_exact():
    """``tokenizer(..., split_special_tokens=True)`` leaves its backend splitting special tokens; pieces the
    cache tokenizes at the backend (a text with an ``lstrip`` token is one) still keep them whole."""
    tokenizer = copy.deepcopy(sentencepiece_style("always"))
    tokens = SegmentTokenizer(tokenizer, TokenIdsCache(1 << 20))
    text = "<|im_start|>user\nfill the <mask> please<|im_end|>\n"
    for turn in range(2):
        tokenizer("an unrelated <mask> call", split_special_tokens=True)
        asked = text * (turn + 1)
        assert tokens.encode(asked) == tokenizer(asked, add_special_tokens=False)["input_ids"]


def test_cache_is_bounded_in_bytes_evicts_least_recently_used_and_counts():
    tokens = SegmentTokenizer(embedded_tokenizer(), TokenIdsCache(20_000))
    texts = [f"<|im_start|>user\nmessage number {i} " + "word " * 40 + "<|im_end|>" for i in range(200)]
    for text in texts:
        assert tokens.encode(text) == embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]
        tokens.encode(texts[0])  # kept recent: never evicted
    stats = tokens.stats()
    assert 0 < stats["token_cache_bytes"] <= 20_000 and stats["token_cache_evictions"] > 0
    assert stats["token_cache_entries"] == len(tokens.cache) < 200
    assert stats["token_cache_misses"] == 200 and stats["token_cache_hits"] == 200
    before = tokens.chars_tokenized
    tokens.encode(texts[0])
    assert tokens.chars_tokenized == before  # still cached
    tokens.encode(texts[1])
    assert tokens.chars_tokenized == before + len(texts[1]) - len("<|im_start|><|im_end|>")  # evicted long ago
    with pytest.raises(ValueError, match="max_bytes"):
        TokenCacheConfig(max_bytes=-1)


@functools.cache
def with_end_token() -> PreTrainedTokenizerFast:
    """``sentencepiece_style("always")`` whose special tokens are ``<s>`` before a text and ``</s>`` after it."""
    tokenizer = copy.deepcopy(sentencepiece_style("always"))
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))],
    )
    return tokenizer


@functools.cache
def prompt_encoder(end_token: bool, max_bytes: int) -> PromptEncoder:
    tokenizer = with_end_token() if end_token else sentencepiece_style("always")
    model = make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256)
    return PromptEncoder(model, tokenizer, SegmentTokenizer(tokenizer, TokenIdsCache(max_bytes)))


@pytest.mark.parametrize("end_token", [False, True])
@pytest.mark.parametrize("max_bytes", [0, 1 << 20])
@settings(max_examples=30, deadline=None)
@given(segments=st.lists(st.sampled_from(["", "hello", " world", "the user", " 123"]), min_size=1, max_size=4))
def test_segment_prompts_have_the_special_tokens_first_and_last_whichever_segments_are_empty(
    end_token, max_bytes, segments
):
    """A segment list's ids are the tokenizer's special prefix (BOS), each segment's own ids, then its special
    suffix (EOS): an empty first segment keeps the BOS, and the EOS ends the prompt, not the first segment."""
    encoder = prompt_encoder(end_token, max_bytes)
    tokenizer = encoder.tokenizer
    own = [tokenizer(segment, add_special_tokens=False)["input_ids"] for segment in segments]
    if not any(own):
        with pytest.raises(InputError, match="empty"):
            encoder.encode_segments(segments)
        return
    prefix, suffix = [tokenizer.bos_token_id], [tokenizer.eos_token_id] if end_token else []
    ids, starts = encoder.encode_segments(segments)
    assert ids == prefix + [token for segment_ids in own for token in segment_ids] + suffix
    assert starts == [0] + [len(prefix) + sum(map(len, own[:index])) for index in range(1, len(own))]
    assert encoder.encode_segments(["".join(segments)])[0] == tokenizer("".join(segments))["input_ids"]


@functools.cache
def tiny_engine() -> InferenceEngine:
    tokenizer = embedded_tokenizer()
    model = make_tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    return InferenceEngine(model, tokenizer, chunking=16)


def test_a_warm_chat_request_tokenizes_only_its_new_messages():
    engine, tokenizer = tiny_engine(), embedded_tokenizer()
    history = [
        {"role": "system", "content": "You are a careful assistant. " * 20},
        {"role": "user", "content": "Summarise the following notes. " + "The notes go on. " * 60},
    ]
    first = engine.generate(history, max_new_tokens=4)
    new = [
        {"role": "assistant", "content": tokenizer.decode(first.output_ids, skip_special_tokens=True)},
        {"role": "user", "content": "And now in one sentence, please."},
    ]
    prompt = engine.render(history + new)
    hits = engine.cache_stats()["token_cache_hits"]
    with CharacterCounter(tokenizer) as counter:
        second = engine.generate(history + new, max_new_tokens=4)
    assert second.cached_tokens > 0 and second.prompt_tokens == len(oracle(tokenizer, prompt)[0])
    # the rendered new messages (each content in one piece with its role line) and nothing else: the system
    # message, the first question and the generation prompt's "assistant\n" come from the cache
    assert counter.chars == sum(len(f"{m['role']}\n{m['content']}") for m in new)
    assert counter.chars <= sum(len(m["content"]) for m in new) + len("assistant\n") * len(new) < len(prompt) // 4
    assert engine.cache_stats()["token_cache_hits"] > hits


@settings(max_examples=40, deadline=None)
@given(
    text=st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join),
    at=st.integers(0, 80),
    surrogate=st.integers(0xD800, 0xDFFF).map(chr),
)
def test_a_lone_surrogate_is_an_input_error_whichever_way_the_text_is_tokenized(text, at, surrogate):
    """No tokenizer takes a lone UTF-16 surrogate (a TypeError deep inside); every path refuses it by name, and
    the same text without it tokenizes as before."""
    bad = text[:at] + surrogate + text[at:]
    off = SegmentTokenizer(embedded_tokenizer(), TokenIdsCache(0))
    for tokens in (segment_tokenizer("embedded"), segment_tokenizer("first"), off):
        with pytest.raises(InputError, match="lone UTF-16 surrogate"):
            tokens.encode(bad, add_special_tokens=True)
        with pytest.raises(InputError, match="lone UTF-16 surrogate"):
            tokens.encode_with_starts(bad)
        assert tokens.encode_with_starts(text) == oracle(tokens.tokenizer, text)
    engine = tiny_engine()
    for prompt in (bad, ["A document.\n", bad], [{"role": "user", "content": bad}]):
        with pytest.raises(InputError, match="lone UTF-16 surrogate"):
            engine.encode_segments(prompt)


def test_the_servers_chat_admission_tokenizes_through_the_engines_cache():
    from helpers import WEATHER_TOOL

    from kvboost_hf.server.admission import Admission
    from kvboost_hf.server.schemas import ChatCompletionRequest
    from kvboost_hf.server.settings import ServerConfig
    from kvboost_hf.server.worker import Worker

    engine, tokenizer = tiny_engine(), embedded_tokenizer()
    admission = Admission(engine, ServerConfig(), Worker(engine, ServerConfig()))
    messages = [{"role": "system", "content": "Server notes. " * 30}, {"role": "user", "content": "Hi there"}]
    admission._chat(ChatCompletionRequest(model="m", messages=messages), None)
    later = [*messages, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    with CharacterCounter(tokenizer) as counter:
        prepared = admission._chat(ChatCompletionRequest(model="m", messages=later, max_tokens=2), None)
    assert prepared.prompt_ids == engine.encode(later)
    assert counter.chars == len("assistant\nHello.") + len("user\nBye")
    # with tools the admission renders the prompt itself and tokenizes it through the same cache
    tools = admission._tool_mode(ChatCompletionRequest(model="m", messages=later, tools=[WEATHER_TOOL]))[0]
    cached = admission._encode_chat(ChatCompletionRequest(model="m", messages=later).messages, tools, True)[0]
    engine.tokens, kept = SegmentTokenizer(tokenizer, TokenIdsCache(0)), engine.tokens  # the tokenizer itself
    try:
        whole = admission._encode_chat(ChatCompletionRequest(model="m", messages=later).messages, tools, True)[0]
    finally:
        engine.tokens = kept
    assert cached == whole
