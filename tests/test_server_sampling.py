"""Per-row logits processors (hf/sampling.py) and tool-call parsing (hf/grammar.py), without a model."""

from __future__ import annotations

import json

import pytest
import torch

from kvboost_hf.hf.sampling import SamplingParams, build_processors, choose_token

EOS = 0


def process(params: SamplingParams, prompt: list[int], generated: list[int], scores: list[float]) -> torch.Tensor:
    processors = build_processors(params, len(prompt), {EOS})
    return processors(torch.tensor([prompt + generated]), torch.tensor([scores]))[0]


def test_greedy_is_argmax_and_tiny_temperatures_are_greedy():
    generator = torch.Generator().manual_seed(0)
    scores = torch.tensor([[1.0, 3.0, 2.0]])
    assert choose_token(scores, SamplingParams(temperature=0), generator) == 1
    assert choose_token(scores, SamplingParams(temperature=1e-30), generator) == 1


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process(params, prompt=[1, 1, 1], generated=[2, 2, 3], scores=[0.0] * 4)
    assert out.tolist() == pytest.approx([0.0, 0.0, -1.0, -0.75])  # token 1 is only in the prompt


def test_repetition_penalty_covers_prompt_and_output():
    out = process(SamplingParams(repetition_penalty=2.0), [1], [2], [4.0, 4.0, -4.0, 4.0])
    assert out.tolist() == [4.0, 2.0, -8.0, 4.0]


def test_logit_bias_min_tokens_and_stop_ids():
    params = SamplingParams(logit_bias=((3, 5.0),), min_tokens=2, stop_token_ids=(2,))
    out = process(params, [1], [3], [1.0, 1.0, 1.0, 1.0])
    assert out[3] == 6.0 and out[EOS] == -float("inf") and out[2] == -float("inf")  # 1 token < min_tokens
    out = process(params, [1], [3, 3], [1.0, 1.0, 1.0, 1.0])
    assert out[EOS] == 1.0 and out[2] == 1.0
    assert params.end_token_ids({EOS}) == {EOS, 2}
    assert SamplingParams(ignore_eos=True, stop_token_ids=(2,)).end_token_ids({EOS}) == {2}


def test_warpers_restrict_the_draw():
    scores = [2.0, 1.9, 0.0, -1.0]
    generator = torch.Generator().manual_seed(0)
    for params, allowed in [
        (SamplingParams(top_k=1, temperature=1.5), {0}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_p=0.3), {0}),
    ]:
        processed = process(params, [1], [], scores)[None]
        picks = {choose_token(processed, params, generator) for _ in range(50)}
        assert picks <= allowed and (len(allowed) == 1 or len(picks) > 1), (params, picks)


def test_a_fully_masked_row_is_an_error_not_a_nan_draw():
    with pytest.raises(ValueError, match="masked"):
        choose_token(torch.full((1, 3), -float("inf")), SamplingParams(), torch.Generator())


def test_parse_tool_calls_keeps_text_and_skips_cut_calls():
    grammar = pytest.importorskip("kvboost_hf.hf.grammar")
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", "argu'
    content, calls = grammar.parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert content.startswith("Sure.") and "argu" in content


def test_tool_call_stream_sends_content_then_growing_arguments():
    grammar = pytest.importorskip("kvboost_hf.hf.grammar")
    full = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = grammar.ToolCallStream()
    content, names, arguments = "", [], ""
    for end in range(1, len(full) + 1):  # one character at a time, as tokens might come
        new, deltas = stream.update(full[:end])
        assert "<" not in new  # a possible start of a tag is held back
        content += new
        names += [d.name for d in deltas if d.name]
        arguments += "".join(d.arguments for d in deltas)
    assert content == "Let me check." and names == ["get_weather"]
    assert json.loads(arguments) == {"city": "Paris"}
    assert stream.update(full, final=True) == ("", [])


@pytest.fixture(scope="module")
def compiler():
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from kvboost_hf.hf.grammar import GrammarCompiler
    from kvboost_hf.hf.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return xgrammar, GrammarCompiler(tokenizer, len(tokenizer))


def test_tool_arguments_and_json_schema_share_the_compact_grammar(compiler):
    """No free whitespace in either: a no-argument call is exactly ``{}``, arguments cannot be padded."""
    xgrammar, grammars = compiler
    from kvboost_hf.hf.grammar import Tool

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [Tool("get_time", {"type": "object"}), Tool("get_weather", city)]
    calls = grammars.tool_calls(tools, required=True, parallel=True).result()
    answer = grammars.json_schema(city).result()

    def accepts(grammar, text: str) -> bool:
        return xgrammar.GrammarMatcher(grammar).accept_string(text)

    def call(name: str, arguments: str) -> str:
        return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'

    assert accepts(calls, call("get_time", "{}")) and accepts(calls, call("get_weather", '{"city": "Paris"}'))
    assert accepts(answer, '{"city": "Paris"}')
    for padded in ['{ "city": "Paris"}', '{"city":"Paris"}', '{"city": "Paris"\n}']:
        assert not accepts(calls, call("get_weather", padded)) and not accepts(answer, padded)
    assert not accepts(calls, call("get_time", "{ }")) and not accepts(calls, call("get_time", "{\n"))
