"""Tool-call formats: grammars that accept what the reader reads, and templates (`test_tool_stream` streams them)."""

from __future__ import annotations

import json
import re

import llguidance
import pytest

from edgeserve.engine.constraints import ll_tokenizer
from edgeserve.sampling_params import GrammarTrigger
from edgeserve.text.chat_template import ChatTemplate
from edgeserve.text.tool_calls import (
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ToolCall,
    after_reasoning,
    format_for_template,
    not_containing,
    tools_grammar,
)
from edgeserve.text.tool_stream import read_answer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
CALLS = [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'), ToolCall("get_time", '{"tz": "CET"}')]
FORMATS = [HermesFormat(), Llama3Format(), MistralFormat()]


@pytest.fixture(scope="module")
def llt(loaded_model) -> llguidance.LLTokenizer:
    return ll_tokenizer(loaded_model.tokenizer, loaded_model.args.vocab_size)


def matches(llt: llguidance.LLTokenizer, tokenizer, grammar: str, text: str, lead: tuple[int, ...] = ()) -> bool:
    """Whether the grammar takes text whole, after the tokens lead (special ones, which no text spells), and is then
    complete."""
    matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.consume_tokens([*lead, *tokenizer.encode(text, add_bos=False)]) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_written_calls_parse_back_and_the_grammar_takes_them(fmt, llt, loaded_model) -> None:
    tokenizer = loaded_model.tokenizer
    for calls, parallel in ((CALLS[:1], False), (CALLS, True)):
        text = fmt.write(calls)
        answer = read_answer(text, fmt)
        assert answer.text == "" and answer.calls == calls
        assert matches(llt, tokenizer, fmt.grammar([WEATHER, TIME], parallel), text)
    # one call only without parallel calls; only the named tools; arguments that follow the schema
    assert not matches(llt, tokenizer, fmt.grammar([WEATHER, TIME], False), fmt.write(CALLS))
    assert not matches(llt, tokenizer, fmt.grammar([TIME], True), fmt.write(CALLS[:1]))
    bad = ToolCall("get_weather", '{"city": "Paris", "unit": "kelvin"}')
    assert not matches(llt, tokenizer, fmt.grammar([WEATHER], False), fmt.write([bad]))
    # JSON as the engine writes it: no free whitespace, which a small model could pour out without end
    assert not matches(llt, tokenizer, fmt.grammar([WEATHER], False), fmt.write(CALLS[:1]).replace(", ", ",\n  "))


@pytest.mark.parametrize("fmt", [HermesFormat(), MistralFormat()], ids=lambda f: f.name)
def test_the_triggered_grammar_binds_calls_from_their_marker_on(fmt, llt, loaded_model) -> None:
    tokenizer = loaded_model.tokenizer
    grammar, trigger = fmt.triggered_grammar([WEATHER, TIME], True)
    assert trigger == GrammarTrigger(text=fmt.marker)
    # it is fed from the token where the marker begins, which may hold text before it
    for text in ("Let me look.\n" + fmt.write(CALLS[:1]), fmt.write(CALLS), " " + fmt.write(CALLS[:1])):
        assert matches(llt, tokenizer, grammar, text), text
    # once opened, a call must follow a tool's schema
    assert not matches(llt, tokenizer, grammar, fmt.write([ToolCall("get_weather", '{"city": 5}')]))
    assert not matches(llt, tokenizer, grammar, fmt.write([ToolCall("get_news", '{"tz": "CET"}')]))
    assert not matches(llt, tokenizer, grammar, f"Sure {fmt.marker} no call here")
    single, _ = fmt.triggered_grammar([WEATHER], False)
    assert not matches(llt, tokenizer, single, fmt.write(CALLS[:1] * 2))


def test_a_marker_token_triggers_mistral_s_calls_from_itself(llt, loaded_model) -> None:
    tokenizer = loaded_model.tokenizer
    marker = tokenizer.token_to_id("<filename>")  # a special token standing for [TOOL_CALLS]
    fmt = MistralFormat(marker_token=marker)
    grammar, trigger = fmt.triggered_grammar([WEATHER, TIME], True)
    assert trigger == GrammarTrigger(token_id=marker)
    for calls, valid in ((CALLS[:1], True), (CALLS, True), ([ToolCall("get_weather", '{"city": 5}')], False),
                         ([ToolCall("get_news", '{"tz": "CET"}')], False)):
        text = fmt.write(calls).removeprefix(fmt.marker)
        assert matches(llt, tokenizer, grammar, text, lead=(marker,)) == valid, text


def test_llama3_calls_are_held_from_the_answer_s_opening(llt, loaded_model) -> None:
    tokenizer = loaded_model.tokenizer
    tag = tokenizer.token_to_id("<filename>")  # a special token standing for <|python_tag|>
    fmt = Llama3Format(marker_token=tag)
    grammar, trigger = fmt.triggered_grammar([WEATHER, TIME], True)
    assert trigger == GrammarTrigger(text="{", token_id=tag, opening=True)
    call = fmt.write(CALLS[:1])
    for text in (call, fmt.write(CALLS), " \n" + call):
        assert matches(llt, tokenizer, grammar, text), text
    assert matches(llt, tokenizer, grammar, call, lead=(tag,))
    # any other opening is taken (the engine lets the grammar go there)
    for text in ("", "Sunny, 21 C.", "I think {not a call}", "\n\nSure: {}"):
        assert matches(llt, tokenizer, grammar, text), text
    # an answer that opens as a call is one, following a tool's schema, written as the engine writes JSON
    for text in ("{not a call}", fmt.write([ToolCall("get_weather", '{"city": 5}')]),
                 fmt.write([ToolCall("get_news", '{"tz": "CET"}')]), call.replace(", ", ",\n  ")):
        assert not matches(llt, tokenizer, grammar, text), text
    single, _ = fmt.triggered_grammar([WEATHER], False)
    assert not matches(llt, tokenizer, single, fmt.write(CALLS[:1] * 2))


def test_every_format_has_a_trigger_under_auto_and_none_where_a_call_is_forced() -> None:
    assert tools_grammar(Llama3Format(), [WEATHER], False, True) == Llama3Format().triggered_grammar([WEATHER], True)
    assert tools_grammar(Llama3Format(), [WEATHER], False, True)[1] == GrammarTrigger(text="{", opening=True)
    assert tools_grammar(HermesFormat(), [WEATHER], True, True) == (HermesFormat().grammar([WEATHER], True), None)
    assert tools_grammar(HermesFormat(), None, True, True) == (None, None)


def test_a_grammar_after_reasoning_lets_the_thoughts_end_first(llt, loaded_model) -> None:
    tokenizer = loaded_model.tokenizer
    schema = WEATHER["function"]["parameters"]
    grammar = after_reasoning("json_schema", json.dumps(schema))
    answer = '{"city": "Paris", "unit": "c"}'
    for text in (f"Paris, then. </b> is no end.</think>\n\n{answer}", f"</think>{answer}"):
        assert matches(llt, tokenizer, grammar, text), text
    assert not matches(llt, tokenizer, grammar, answer)  # the section must end first
    assert not matches(llt, tokenizer, grammar, "Hmm.</think>\nSunny.")  # and then the grammar binds
    calls = after_reasoning("lark", HermesFormat().grammar([WEATHER], False))
    assert matches(llt, tokenizer, calls, "Hmm.</think>\n" + HermesFormat().write(CALLS[:1]))
    assert after_reasoning("regex", "[a-z]+") is None


def test_text_without_a_marker_is_every_text_the_marker_does_not_occur_in() -> None:
    free = re.compile(not_containing("<tool_call>"))
    for text in ("", "hello", "a <b> c", "<<tool", "x <tool_cal", "<tool_call", "<t<tool", "a<tool_callx>"):
        assert free.fullmatch(text), text
    for text in ("<tool_call>", "x<tool_call>y", "<t<tool_call>", "<<tool_call>"):
        assert not free.fullmatch(text), text


def test_the_format_comes_from_the_template() -> None:
    assert isinstance(format_for_template("{{ '<tool_call>' }}"), HermesFormat)
    assert isinstance(format_for_template("{{ '[TOOL_CALLS]' }}", {"[TOOL_CALLS]": 5}.get), MistralFormat)
    assert "<[5]>" in format_for_template("[TOOL_CALLS]", {"[TOOL_CALLS]": 5}.get).grammar([WEATHER], False)
    assert isinstance(format_for_template("{{ '<|python_tag|>' }}"), Llama3Format)
    assert format_for_template("{{ '<|python_tag|>' }}", {"<|python_tag|>": 7}.get).marker_token == 7
    assert isinstance(format_for_template("{{ messages }}"), HermesFormat)


# A template in the Hugging Face style: a `tools` variable, assistant tool_calls, tool messages.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "[call {{ c['id'] }} {{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}]{% endfor %}\n"
    "{% elif m['role'] == 'tool' %}[result {{ m['tool_call_id'] }} {{ m['content'] }}]\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
]


def test_tools_and_tool_history_render_through_a_template_that_takes_them() -> None:
    template = ChatTemplate(TOOLS_TEMPLATE)
    assert template.supports_tools
    text = template.render(HISTORY, tools=[WEATHER, TIME])
    assert text.startswith("<tools>get_weather;get_time;</tools>")
    assert '[call call_1 get_weather {"city": "Paris"}]' in text and "[result call_1 21 C]" in text


def test_templates_without_tools_get_the_fallback_prompt() -> None:
    template = ChatTemplate(None)  # ChatML, which knows no tools
    assert not template.supports_tools
    text = template.render(HISTORY, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>" in text
    assert "You may call" not in template.render(HISTORY)  # the history alone renders as text, no tools offered
