"""Segment starts of chat messages (kvboost_hf.hf.chat_segments): the token ids are today's rendering whatever the
boundaries, and each start is the first token at or after a marked content offset; through the engine, reordered
and warmed documents hit. The embedded tokenizer with a tiny random model: fast."""

from __future__ import annotations

import copy
import functools

import pytest
from conftest import make_tiny_model, noisy_copy
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import engine_reference
from transformers import AutoTokenizer

from kvboost_hf.core.config import RepairConfig
from kvboost_hf.core.errors import InputError
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.chat_segments import encode_chat_segments, joined
from kvboost_hf.hf.context_attention import adjusted_attention
from kvboost_hf.hf.models import embedded_model_dir

TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{{ '<|im_start|>assistant\n' }}"
)


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def todays_ids(messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """What the engine tokenised before segments existed: the rendered template, no special tokens added."""
    text = tokenizer().apply_chat_template(
        joined(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(tokenizer()(text, add_special_tokens=False)["input_ids"])


def marked_offsets(messages, boundaries: str, trim: bool = False) -> list[int]:
    """Character offsets the test expects marked, from the template's own layout (checked against its rendering):
    the embedded template's optional default system turn (not with ``trim``: :data:`TRIMMING_TEMPLATE`), then
    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, the content stripped with ``trim`` (a part's offset
    then moves back by the stripped lead, clamped to the stripped content)."""
    template = {"chat_template": TRIMMING_TEMPLATE} if trim else {}
    text = tokenizer().apply_chat_template(joined(messages), tokenize=False, add_generation_prompt=True, **template)
    system_first = trim or messages[0]["role"] == "system"
    position = 0 if system_first else text.index("<|im_end|>\n") + len("<|im_end|>\n")
    rebuilt, offsets = text[:position], []
    for message in messages:
        content = message["content"]
        parts = [content] if isinstance(content, str) else content
        whole = "".join(parts)
        shown = whole.strip() if trim else whole
        lead = len(whole) - len(whole.lstrip()) if trim else 0
        head = f"<|im_start|>{message['role']}\n"
        start = position + len(head)
        if boundaries == "messages" or (boundaries == "parts" and len(parts) >= 2):
            inside = [sum(map(len, parts[:k])) - lead for k in range(len(parts) + 1)]
            offsets += [start + min(max(offset, 0), len(shown)) for offset in inside]
        rebuilt += head + shown + "<|im_end|>\n"
        position = len(rebuilt)
    assert rebuilt + "<|im_start|>assistant\n" == text
    return sorted(set(offsets))


def first_token_at_or_after(ids: list[int], char: int) -> int:
    """The first token whose text begins at or after ``char``, found by decoding prefixes (not offsets)."""
    decode = functools.partial(tokenizer().decode, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return next(k for k in range(len(ids) + 1) if len(decode(ids[:k])) >= char)


TEXT = st.text(alphabet="ab cd.\n,é?-XY1", max_size=24)
CONTENT = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=4))
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": CONTENT}),
    min_size=1,
    max_size=4,
)


@settings(max_examples=80, deadline=None)
@given(messages=MESSAGES, boundaries=st.sampled_from(["none", "parts", "messages"]), trim=st.booleans())
def test_ids_are_todays_and_starts_begin_the_marked_contents(messages, boundaries, trim):
    template = {"chat_template": TRIMMING_TEMPLATE} if trim else {}
    ids, starts = encode_chat_segments(tokenizer(), messages, boundaries=boundaries, **template)
    assert ids == todays_ids(messages, **template)
    assert starts == sorted(set(starts)) and all(0 < s < len(ids) for s in starts)
    expected = [first_token_at_or_after(ids, char) for char in marked_offsets(messages, boundaries, trim)]
    assert starts == sorted({s for s in expected if 0 < s < len(ids)})


def test_a_document_after_a_newline_starts_exactly_on_its_first_token():
    documents = ["Owls hunt at night.\n", "Cats sleep all day.\n", "Which animal sleeps?"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": documents}]
    ids, starts = encode_chat_segments(tokenizer(), messages)
    decode = tokenizer().decode
    assert [decode(ids[s:]).startswith(doc) for s, doc in zip(starts, documents, strict=False)] == [True] * 3
    assert decode(ids[starts[3] :]).startswith("<|im_end|>")  # the content's end starts the template's text
    alone = [tokenizer()(doc, add_special_tokens=False)["input_ids"] for doc in documents[:2]]
    assert [ids[starts[0] : starts[1]], ids[starts[1] : starts[2]]] == alone  # as a warmed document


def test_a_part_that_merges_with_the_next_starts_after_the_merged_token():
    messages = [{"role": "user", "content": ["There are many cat", "s in the house.", " Why?"]}]
    ids, starts = encode_chat_segments(tokenizer(), messages)
    assert ids == todays_ids(messages)
    merged = tokenizer().decode(ids[starts[1] - 1 : starts[1]])
    assert merged == " cats" and tokenizer().decode(ids[starts[1] :]).startswith(" in the house.")


def test_which_contents_are_marked():
    one_part = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ["Hello there."]}]
    assert encode_chat_segments(tokenizer(), one_part, boundaries="parts")[1] == []
    assert encode_chat_segments(tokenizer(), one_part, boundaries="none")[1] == []
    assert len(encode_chat_segments(tokenizer(), one_part, boundaries="messages")[1]) == 4
    with pytest.raises(ValueError, match="'everything' is not a valid DocumentBoundaries"):
        encode_chat_segments(tokenizer(), one_part, boundaries="everything")


def test_a_trimming_template_gets_segments_at_the_trimmed_contents():
    messages = [{"role": "user", "content": ["  A padded document.\n", "Question?  "]}]
    ids, starts = encode_chat_segments(tokenizer(), messages, chat_template=TRIMMING_TEMPLATE)
    assert ids == todays_ids(messages, chat_template=TRIMMING_TEMPLATE)
    decode = tokenizer().decode
    firsts = [decode(ids[s:]).split("\n")[0] for s in starts]
    assert firsts == ["A padded document.", "Question?<|im_end|>", "<|im_end|>"]


def test_a_template_that_changes_contents_gets_no_segments():
    messages = [{"role": "user", "content": ["A document. ", "Question?"]}]
    upper = TRIMMING_TEMPLATE.replace("| trim", "| upper")
    ids, starts = encode_chat_segments(tokenizer(), messages, chat_template=upper)
    assert ids == todays_ids(messages, chat_template=upper) and starts == []


REFUSING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if '\ue000' in m['content'] %}{{ raise_exception('private use character') }}"
    "{% endif %}{% endfor %}" + TRIMMING_TEMPLATE
)


def test_messages_the_template_refuses_are_an_input_error_naming_its_reason():
    """A template's ``raise_exception`` (Gemma's, Mistral's for a system role) is an InputError, through the
    engine too; one refusing only the sentinels that place contents leaves the prompt without segments."""
    refused = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(InputError, match="chat template refused the messages: System role not supported"):
        encode_chat_segments(tokenizer(), refused, chat_template=REFUSING_TEMPLATE)
    refusing = copy.deepcopy(tokenizer())
    refusing.chat_template = REFUSING_TEMPLATE
    model = make_tiny_model("llama", vocab_size=len(refusing), max_position_embeddings=256)
    engine = InferenceEngine(model, refusing, chunking=8)
    for call in (engine.render, engine.encode, functools.partial(engine.generate, max_new_tokens=1)):
        with pytest.raises(InputError, match="System role not supported"):
            call(refused)
    parts = [{"role": "user", "content": ["A document. ", "Question?"]}]
    ids, starts = encode_chat_segments(tokenizer(), parts, chat_template=REFUSING_TEMPLATE)
    assert ids == todays_ids(parts, chat_template=REFUSING_TEMPLATE) and starts == []


# ---------------------------------------------------------------------------------------------- through the engine
DOCUMENTS = [
    "The north archive keeps the harbour maps; its access code is 4821.\n",
    "The south archive holds the tax records; its access code is 7310.\n",
    "The east archive stores the founders' letters; its access code is 5594.\n",
]


def rag_chat(order: list[int]) -> list[dict]:
    parts = [DOCUMENTS[i] for i in order] + ["What is the code of the south archive?"]
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": parts}]


def tiny_engine(repair: RepairConfig) -> InferenceEngine:
    """A 2-layer random Llama over the embedded tokenizer: the chat template and token ids are the real ones."""
    model = make_tiny_model("llama", vocab_size=len(tokenizer()), max_position_embeddings=1024)
    return InferenceEngine(model, tokenizer(), chunking=8, repair=repair)


def test_engine_chat_parts_are_segments_with_todays_ids():
    engine = tiny_engine(RepairConfig())
    ids, starts = engine.encode_segments(rag_chat([0, 1, 2]))
    assert ids == todays_ids(rag_chat([0, 1, 2])) == engine.encode(joined(rag_chat([0, 1, 2])))
    assert len(starts) == 5  # four parts and the content's end
    assert engine.encode_segments(rag_chat([0, 1, 2]), document_boundaries="none") == (ids, [])
    assert engine.render(rag_chat([0, 1, 2])) == tokenizer().decode(ids)


def test_engine_reordered_parts_equal_a_full_prefill_with_full_repair():
    engine = tiny_engine(RepairConfig("cacheblend", ratio=1.0))
    engine.generate(rag_chat([0, 1, 2]), 6)
    reordered = engine.generate(rag_chat([2, 0, 1]), 6)
    full = engine_reference(engine, rag_chat([2, 0, 1]), 6)  # transformers' greedy tokens for the full prompt
    assert reordered.recomputed_tokens > 0  # content hits, found at new positions, all recomputed
    assert reordered.output_ids == full.tokens


def test_an_engine_with_a_context_temperature_attends_to_warmed_documents_adjusted(monkeypatch):
    """The engine switches its model to the kvboost attention for a repair with APE's temperature; reordered
    warmed documents are then attended with the adjustment by the prompt forward and by every decode step."""
    engine = tiny_engine(RepairConfig("none", context_temperature=0.5))
    assert engine.model.config._attn_implementation == "kvboost"
    engine.warm_documents(DOCUMENTS)
    calls = []

    def spy(*args):
        calls.append(args[5])
        return adjusted_attention(*args)

    monkeypatch.setattr("kvboost_hf.hf.attention.adjusted_attention", spy)
    adjusted = engine.generate(rag_chat([2, 0, 1]), 3)
    assert adjusted.cached_tokens > 0 and len(calls) == 3 * engine.model.config.num_hidden_layers  # 3 forwards


def test_a_draft_model_proposes_without_the_context_adjustment():
    """The draft only proposes (the target decides every token), so its cache gets the repair without APE's
    temperature: its model keeps its own attention, and speculative decoding runs beside an adjusted target."""
    model = make_tiny_model("llama", vocab_size=len(tokenizer()), max_position_embeddings=1024)
    draft = noisy_copy(model, 0.05, seed=1)
    engine = InferenceEngine(
        model, tokenizer(), chunking=8, repair=RepairConfig("none", context_temperature=0.5), draft_model=draft
    )
    assert draft.config._attn_implementation == "sdpa"
    engine.warm_documents(DOCUMENTS)
    result = engine.generate(rag_chat([2, 0, 1]), 4)
    assert result.cached_tokens > 0 and len(result.output_ids) == 4
    plain = InferenceEngine(model, tokenizer(), chunking=8, repair=RepairConfig("none", context_temperature=0.5))
    plain.warm_documents(DOCUMENTS)
    assert plain.generate(rag_chat([2, 0, 1]), 4).output_ids == result.output_ids  # the draft changes no token


def test_warmed_documents_hit_whole_in_any_order():
    engine = tiny_engine(RepairConfig("none"))
    results = engine.warm_documents(DOCUMENTS)
    lengths = [len(tokenizer()(doc, add_special_tokens=False)["input_ids"]) for doc in DOCUMENTS]
    assert [result.token_count for result in results] == lengths
    reordered = engine.generate(rag_chat([1, 2, 0]), 2)
    assert reordered.cached_tokens >= sum(lengths)  # every token of every document, last partial chunks included


def test_a_warmed_segment_list_stores_its_last_partial_chunk_as_a_string_does():
    """``warm([header, document])`` stores the document as computed after the header, whole: a prompt holding it
    as a segment elsewhere hits every one of its tokens, as after ``warm(document)``."""
    header, document, question = "You answer from the documents.\n", DOCUMENTS[0], "Which one?"
    length = len(tokenizer()(document, add_special_tokens=False)["input_ids"])
    for warmed in (document, [header, document]):
        engine = tiny_engine(RepairConfig("none"))
        engine.warm(warmed)
        result = engine.generate(["Another header first.\n", document, question], 2)
        assert result.approx_tokens == length
