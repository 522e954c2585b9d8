"""The answer reader: text, reasoning and tool calls streamed as they are written, in every call format."""

from __future__ import annotations

import json

import pytest

from edgeserve.text.tool_calls import HermesFormat, Llama3Format, MistralFormat, ToolCall
from edgeserve.text.tool_stream import (
    AnswerEvents,
    CallArguments,
    CallEnded,
    CallStarted,
    Event,
    ReasoningText,
    Text,
    opens_reasoning,
    read_answer,
)

CALLS = [ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'), ToolCall("get_time", '{"tz": "CET"}')]
FORMATS = [HermesFormat(), Llama3Format(), MistralFormat()]
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name"', "<think>", "</think>")


def stream(answer: AnswerEvents, text: str, step: int, cut: bool = False) -> list[Event]:
    events = []
    for i in range(0, len(text), step):
        events += answer.feed(text[i:i + step])
    return events + answer.finish(cut)


def texts(events: list[Event], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def assembled(events: list[Event]) -> list[tuple[str, str, bool]]:
    """The calls the events describe, as a client assembles them: (name, arguments, complete)."""
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, CallStarted):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls[e.index] = [e.name, "", None]
        elif isinstance(e, CallArguments):
            calls[e.index][1] += e.fragment
        elif isinstance(e, CallEnded):
            calls[e.index][2] = e.complete
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_stream_as_they_are_written_in_every_format(fmt, step: int) -> None:
    prefix = "" if isinstance(fmt, Llama3Format) else "Let me look.\n"  # Llama 3's message is the call
    text = prefix + fmt.write(CALLS)
    answer = AnswerEvents(fmt)
    events = stream(answer, text, step)
    assert texts(events, Text) == prefix.strip() == answer.text
    assert not any(m in texts(events, Text) for m in MARKUP)
    assert assembled(events) == [(c.name, c.arguments, True) for c in CALLS]
    assert answer.calls == CALLS and len(set(answer.call_ids)) == 2
    if step == 1:  # the name comes before the arguments are done, and they come in many pieces
        first_args = [i for i, e in enumerate(events) if isinstance(e, CallArguments) and e.index == 0]
        assert len(first_args) > 10 and events.index(next(e for e in events if isinstance(e, CallStarted))) < \
            first_args[0]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_calls_without_their_special_marker_token_still_parse(fmt) -> None:
    # Output text leaves special tokens out: Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|> are ones,
    # and some Hermes-style tokenizers hold <tool_call> and </tool_call> as special tokens too.
    text = fmt.write(CALLS).replace(fmt.marker, "").replace("</tool_call>", "")
    events = stream(AnswerEvents(fmt), text, 2)
    assert texts(events, Text) == "" and assembled(events) == [(c.name, c.arguments, True) for c in CALLS]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("cut", [3, 20, 40, 52])
def test_a_call_cut_short_leaves_no_markup_in_the_text(fmt, cut: int) -> None:
    whole = fmt.write(CALLS[:1])
    prefix = "" if isinstance(fmt, Llama3Format) else "Sure. "
    text = prefix + whole[:cut]
    answer = AnswerEvents(fmt)
    events = stream(answer, text, 2, cut=True)
    assert texts(events, Text) == prefix.strip() and answer.calls == []
    calls = assembled(events)
    # a call announced before the cut ends incomplete; one cut before its name is never announced
    assert all(not complete for _, _, complete in calls)
    assert read_answer(text, fmt, cut=True).text == prefix.strip()


def test_text_that_is_no_call_stays_text() -> None:
    assert read_answer("Paris is sunny.", HermesFormat()).text == "Paris is sunny."
    assert read_answer("I think {not a call}", Llama3Format()).text == "I think {not a call}"
    assert read_answer("[1, 2] are numbers", MistralFormat()).text == "[1, 2] are numbers"
    assert read_answer('{"answer": 5}', HermesFormat()).text == '{"answer": 5}'  # JSON, but no call
    assert read_answer("a < b and <tool", HermesFormat()).text == "a < b and <tool"  # held back, then let go
    assert read_answer("no tools here <tool_call>", None).text == "no tools here <tool_call>"


def test_arguments_written_as_a_string_or_first_still_make_a_call() -> None:
    for body in ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"arguments": {"a": 1}, "name": "f"}'):
        answer = read_answer(f"<tool_call>\n{body}\n</tool_call>", HermesFormat())
        assert answer.text == "" and [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("f", {"a": 1})]


@pytest.mark.parametrize("step", [1, 4])
def test_a_reasoning_section_comes_apart(step: int) -> None:
    fmt = HermesFormat()
    text = "<think>\nThe user wants the weather.\n</think>\n\nChecking. " + fmt.write(CALLS[:1])
    answer = AnswerEvents(fmt)
    events = stream(answer, text, step)
    assert texts(events, ReasoningText) == "\nThe user wants the weather.\n" == answer.reasoning_text
    assert texts(events, Text) == "Checking." and answer.calls == CALLS[:1]
    # the prompt opened it: the answer starts inside, with only the closing tag
    opened = read_answer("Hmm.</think>It is 4.", None, in_reasoning=True)
    assert (opened.reasoning_text, opened.text) == ("Hmm.", "It is 4.")
    # kept inline on request
    assert read_answer("<think>Hmm.</think>It is 4.", None, reasoning=False).text == "<think>Hmm.</think>It is 4."
    # only a leading section is reasoning
    assert read_answer("It is <think> 4.", None).text == "It is <think> 4."
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("<|im_start|>assistant\n")
