"""Per-row logits processors (hf/sampling.py) and tool-call parsing (server/grammar.py), without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvboost_hf.hf.sampling import SamplingConfig, build_processors, choose_token

EOS = 0


def process(params: SamplingConfig, prompt: list[int], generated: list[int], scores: list[float]) -> torch.Tensor:
    processors = build_processors(params, len(prompt), {EOS})
    return processors(torch.tensor([prompt + generated]), torch.tensor([scores]))[0]


def test_greedy_is_argmax_and_tiny_temperatures_are_greedy():
    generator = torch.Generator().manual_seed(0)
    scores = torch.tensor([[1.0, 3.0, 2.0]])
    assert choose_token(scores, SamplingConfig(temperature=0), generator) == 1
    assert choose_token(scores, SamplingConfig(temperature=1e-30), generator) == 1


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    params = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = process(params, prompt=[1, 1, 1], generated=[2, 2, 3], scores=[0.0] * 4)
    assert out.tolist() == pytest.approx([0.0, 0.0, -1.0, -0.75])  # token 1 is only in the prompt


def test_repetition_penalty_covers_prompt_and_output():
    out = process(SamplingConfig(repetition_penalty=2.0), [1], [2], [4.0, 4.0, -4.0, 4.0])
    assert out.tolist() == [4.0, 2.0, -8.0, 4.0]


def test_logit_bias_min_tokens_and_stop_ids():
    params = SamplingConfig(logit_bias=((3, 5.0),), min_tokens=2, stop_token_ids=(2,))
    out = process(params, [1], [3], [1.0, 1.0, 1.0, 1.0])
    assert out[3] == 6.0 and out[EOS] == -float("inf") and out[2] == -float("inf")  # 1 token < min_tokens
    out = process(params, [1], [3, 3], [1.0, 1.0, 1.0, 1.0])
    assert out[EOS] == 1.0 and out[2] == 1.0
    assert params.end_token_ids({EOS}) == {EOS, 2}
    assert SamplingConfig(ignore_eos=True, stop_token_ids=(2,)).end_token_ids({EOS}) == {2}
    ignoring = SamplingConfig(min_tokens=2, stop_token_ids=(2,), ignore_eos=True)  # EOS is no end: not banned
    out = process(ignoring, [1], [3], [1.0, 1.0, 1.0, 1.0])
    assert out[EOS] == 1.0 and out[2] == -float("inf")


def test_warpers_restrict_the_draw():
    scores = [2.0, 1.9, 0.0, -1.0]
    generator = torch.Generator().manual_seed(0)
    for params, allowed in [
        (SamplingConfig(top_k=1, temperature=1.5), {0}),
        (SamplingConfig(top_k=2), {0, 1}),
        (SamplingConfig(min_p=0.5), {0, 1}),
        (SamplingConfig(top_p=0.3), {0}),
    ]:
        processed = process(params, [1], [], scores)[None]
        picks = {choose_token(processed, params, generator) for _ in range(50)}
        assert picks <= allowed and (len(allowed) == 1 or len(picks) > 1), (params, picks)


def test_a_fully_masked_row_is_an_error_not_a_nan_draw():
    with pytest.raises(ValueError, match="masked"):
        choose_token(torch.full((1, 3), -float("inf")), SamplingConfig(), torch.Generator())


CALLS = [
    ("get_weather", '{"city": "Paris"}'),
    ("get_weather", '{"city": "a \\"}</tool_call>", "days": [1, {"b": "}"}]}'),  # markup inside a string value
]


def tag(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


ANSWER = "Let me check. " + "\n".join(tag(*call) for call in [*CALLS, CALLS[0]])  # ... and a repeat of the first


def test_tool_calls_read_the_same_whole_and_streamed_at_every_cut():
    """Cut the answer anywhere (as max_tokens does): no markup in content or arguments, every call's arguments are
    a prefix of the real ones, a repeat is dropped, and a stream adds up to the whole answer."""
    grammar = pytest.importorskip("kvboost_hf.server.grammar")
    assert grammar.parse_tool_calls(ANSWER) == ("Let me check.", [grammar.ToolCall(*call) for call in CALLS])
    assert grammar.parse_tool_calls(tag(*CALLS[0])) == ("", [grammar.ToolCall(*CALLS[0])])
    for cut in range(len(ANSWER) + 1):
        text = ANSWER[:cut]
        content, calls = grammar.parse_tool_calls(text)
        assert "Let me check. ".startswith(content) and len(calls) <= len(CALLS), text
        for call, (name, arguments) in zip(calls, CALLS, strict=False):
            assert call.name == name and arguments.startswith(call.arguments), text
            assert call.complete == (call.arguments == arguments), text
        stream = grammar.ToolCallStream()
        streamed, names, arguments_sent = "", [], []
        for end in [*range(1, cut + 1), cut]:  # one character at a time, as tokens might come, then the end
            new, deltas = stream.update(text[:end], final=end == cut)
            streamed += new
            for delta in deltas:
                if delta.name is not None:
                    names.append(delta.name)
                    arguments_sent.append("")
                arguments_sent[delta.index] += delta.arguments
        assert (streamed, names, arguments_sent) == (content, [c.name for c in calls], [c.arguments for c in calls])


def test_tool_call_reading_drops_a_trailing_partial_tag_and_waits_on_whitespace():
    grammar = pytest.importorskip("kvboost_hf.server.grammar")
    assert grammar.parse_tool_calls("Sure <tool_c") == ("Sure ", [])
    assert grammar.parse_tool_calls("Sure \n") == ("Sure \n", [])  # no call follows: the text is the content
    assert grammar.ToolCallStream().update("Sure \n") == ("Sure", [])  # a call may still follow


@pytest.fixture(scope="module")
def grammars():
    """xgrammar, the embedded model's tokenizer and a grammar compiler for it."""
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from kvboost_hf.hf.models import embedded_model_dir
    from kvboost_hf.server.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return SimpleNamespace(xgrammar=xgrammar, tokenizer=tokenizer, compiler=GrammarCompiler(tokenizer, len(tokenizer)))


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_tool_arguments_and_json_schema_share_the_compact_grammar(grammars):
    """No free whitespace in either: a no-argument call is exactly ``{}``, arguments cannot be padded."""
    from kvboost_hf.server.grammar import Tool

    tools = [Tool("get_time", {"type": "object"}), Tool("get_weather", CITY)]
    calls = grammars.compiler.tool_calls(tools, required=True, parallel=True).result()
    answer = grammars.compiler.json_schema(CITY).result()

    def accepts(grammar, text: str) -> bool:
        return grammars.xgrammar.GrammarMatcher(grammar).accept_string(text)

    assert accepts(calls, tag("get_time", "{}")) and accepts(calls, tag("get_weather", '{"city": "Paris"}'))
    assert accepts(answer, '{"city": "Paris"}')
    for padded in ['{ "city": "Paris"}', '{"city":"Paris"}', '{"city": "Paris"\n}']:
        assert not accepts(calls, tag("get_weather", padded)) and not accepts(answer, padded)
    assert not accepts(calls, tag("get_time", "{ }")) and not accepts(calls, tag("get_time", "{\n"))


def test_tool_call_processor_ends_the_turn_at_a_repeated_call(grammars):
    """Under ``required`` with parallel calls the grammar allows calls without end; a repeat ends the turn, and so
    does a budget too small for another call as long as the shortest one so far."""
    from kvboost_hf.server.grammar import Tool

    grammar = grammars.compiler.tool_calls([Tool("get_weather", CITY)], required=True, parallel=True).result()
    tokenizer = grammars.tokenizer
    prompt = tokenizer.encode("Weather?")
    ends = set(grammar.tokenizer_info.stop_token_ids)

    def allowed_after(text: str, max_new_tokens: int = 256) -> set[int]:
        processor = grammars.compiler.tool_call_processor(grammar, len(prompt), tokenizer.decode, max_new_tokens)
        ids = prompt + tokenizer.encode(text, add_special_tokens=False)
        scores = processor(torch.tensor([ids]), torch.zeros(1, len(tokenizer)))
        return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())

    paris, rome = tag("get_weather", '{"city": "Paris"}'), tag("get_weather", '{"city": "Rome"}')
    assert allowed_after(paris) > ends and allowed_after(f"{paris}\n{rome}") > ends  # another call may follow
    assert allowed_after(f"{paris}\n{rome}\n{paris}") == ends
    call = len(tokenizer.encode(paris, add_special_tokens=False))
    assert allowed_after(paris, 2 * call + 2) > ends  # room for one more call of that length
    assert allowed_after(paris, 2 * call - 1) == ends  # none: the turn ends with its complete call
    two = len(tokenizer.encode(f"{paris}\n{rome}", add_special_tokens=False))
    assert allowed_after(f"{paris}\n{rome}", two + two // 2 + 1) > ends  # two calls seen at once: each half the span
