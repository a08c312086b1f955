"""The grammar processors (``server/grammar.py``): host work per token that does not grow with the answer, and a
tool-call turn that still ends on a repeated call exactly as a whole-text reading decides."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string

from kvboost_hf.bench.shapes import tokenizer_dir
from kvboost_hf.server.grammar import (
    GrammarError,
    Tool,
    ToolCallProcessor,
    _read,
    compact_json_grammar,
    tool_call_structure,
)

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


@pytest.fixture(scope="module")
def compiled(tokenizer):
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgrammar.GrammarCompiler(info).compile_structural_tag(tool_call_structure([WEATHER], False, True))


class CountingDecode:
    """``tokenizer.decode`` that counts the ids it was given (the host work the processor asks for)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids = 0

    def __call__(self, ids: list[int]) -> str:
        self.ids += len(ids)
        return self.tokenizer.decode(ids)


def feed(processor: ToolCallProcessor, prompt: list[int], answer: list[int], vocab: int) -> list[bool]:
    """Run ``processor`` over ``answer`` token by token (as generate() calls it); per step, whether it allowed
    only end tokens (the turn must end)."""
    ends_only = []
    for step in range(len(answer) + 1):
        ids = torch.tensor([prompt + answer[:step]])
        scores = processor(ids, torch.zeros(1, vocab))
        allowed = torch.isfinite(scores[0]).nonzero().flatten().tolist()
        ends_only.append(bool(allowed) and set(allowed) <= set(processor.end_token_ids))
    return ends_only


def test_a_long_tool_answer_decodes_a_bounded_window_per_token_and_ends_on_the_repeat(tokenizer, compiled):
    """Free text, then the same call twice: the processor decodes O(1) ids per token (the whole answer each step
    would be quadratic), reads the text for calls only at an end of call, and allows only end tokens as soon as the
    grammar lets the turn end after the repeat (a whole-text reading, _read, finds the repeat a few tokens before:
    when its arguments close)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = "Let me look that up for you, one moment please. " * 6 + call + "\n" + call
    answer = tokenizer.encode(text, add_special_tokens=False)
    decode = CountingDecode(tokenizer)
    vocab = len(tokenizer)
    processor = ToolCallProcessor(compiled, 3, vocab, decode, max_new_tokens=4 * len(answer))
    ends_only = feed(processor, [1, 2, 3], answer, vocab)
    assert decode.ids <= 8 * len(answer)  # whole-text decoding: len(answer) ** 2 / 2 ids
    repeat_seen = next(
        step for step in range(len(answer) + 1) if _read(tokenizer.decode(answer[:step]), final=False).repeated
    )  # the repeated call's arguments close here; the grammar then still wants its </tool_call>
    assert repeat_seen < len(answer) and ends_only.index(True) == len(answer)  # right after that end tag
    assert processor.complete_calls == 1 and processor.repeated
    assert json.loads(_read(text, final=True).calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("schema", "accepted", "refused"),
    [
        ({"type": "object", "required": ["name"]}, '{"name": 1}', "{}"),
        (
            {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["name"]},
            '{"age": 3, "name": "x"}',
            '{"age": 123}',
        ),
        ({"type": "object", "required": ["n"], "additionalProperties": {"type": "integer"}}, '{"n": 1}', '{"n": "a"}'),
        ({"type": "object", "const": {"required": ["x"]}, "required": []}, '{"required":["x"]}', '{"required":[]}'),
    ],
)
def test_a_required_property_outside_properties_is_in_every_answer(schema, accepted, refused):
    """xgrammar drops a required name missing from ``properties``, so ``{"required": ["name"]}`` answered ``{}``;
    the name is added with the schema ``additionalProperties`` gives it (data under ``const`` is left alone)."""
    grammar = compact_json_grammar(schema)
    assert _is_grammar_accept_string(grammar, accepted) and not _is_grammar_accept_string(grammar, refused)


def test_a_required_property_that_additional_properties_false_forbids_is_refused():
    with pytest.raises(GrammarError, match="required property 'name' is not in properties and additionalProperties"):
        compact_json_grammar({"type": "object", "required": ["name"], "additionalProperties": False})
