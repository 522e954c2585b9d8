"""Chat Completions tool calls streamed as they are written, on the real default model with the official client."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator

import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from loopback import serving

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
MARKUP = ("<tool_call>", "</tool_call>", '{"name"')


@pytest.fixture(scope="module")
def client(loaded_model) -> Iterator[openai.OpenAI]:
    with serving(loaded_model, "model") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_call_streams_its_arguments_in_fragments_as_openai_does(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="model", messages=ASK, tools=[WEATHER], tool_choice=FORCED,
                                                 temperature=0, max_tokens=120, stream=True))
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    first, rest = calls[0], calls[1:]
    assert first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(rest) >= 3 and all(c.id is None and c.function.name is None and c.index == 0 for c in rest)
    arguments = "".join(c.function.arguments for c in rest)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    whole = client.chat.completions.create(model="model", messages=ASK, tools=[WEATHER], tool_choice=FORCED,
                                           temperature=0, max_tokens=120).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("get_weather", arguments)]


@pytest.mark.parametrize("max_tokens", [3, 12])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_ends_with_length_and_no_markup(client: openai.OpenAI, max_tokens: int,
                                                                  stream: bool) -> None:
    kwargs = dict(model="model", messages=ASK, tools=[WEATHER], tool_choice=FORCED, temperature=0,
                  max_tokens=max_tokens)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        assert not choice.message.tool_calls  # a half call is no call
    assert finish == "length"
    assert not any(m in content for m in MARKUP), content


def test_auto_tool_choice_keeps_markup_out_and_calls_valid(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(model="model", messages=ASK, tools=[WEATHER], seed=seed,
                                               temperature=1.0, max_tokens=80).choices[0]
        assert not any(m in (reply.message.content or "") for m in MARKUP[:2]), reply.message.content
        # a call the model opens follows the tool's schema (the grammar binds from the marker on)
        for call in reply.message.tool_calls or []:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


# Llama 3.1's tool prompt over ChatML, which the model knows: a tool result is an `ipython` turn, and a call is the
# whole answer, a JSON object with no marker before it.
LLAMA3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ 'ipython' if message['role'] == 'tool' else message['role'] }}\n"
    "{% if loop.last and tools %}Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llama3_client(loaded_model) -> Iterator[openai.OpenAI]:
    tokenizer = copy.copy(loaded_model.tokenizer)
    tokenizer.chat_template = LLAMA3_TEMPLATE
    with serving(dataclasses.replace(loaded_model, tokenizer=tokenizer), "model") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_auto_tool_choice_holds_a_llama3_call_from_its_first_character(llama3_client: openai.OpenAI) -> None:
    calls = 0
    for seed in range(8):
        reply = llama3_client.chat.completions.create(model="model", messages=ASK, tools=[WEATHER], seed=seed,
                                                      temperature=1.0, max_tokens=80).choices[0]
        # an answer that opens as an object is a call, and follows the tool's schema (the grammar holds from the
        # opening on); other answers are free text
        assert not (reply.message.content or "").lstrip().startswith("{"), reply.message.content
        for call in reply.message.tool_calls or []:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            calls += 1
    assert calls  # the seeds' answers open with a call now and then


class Worked(BaseModel):
    """A reasoning-first schema: its order only helps if the model writes the reasoning before the answer."""

    reasoning: str = Field(max_length=80)
    answer: int


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_create_partial_yields_growing_objects_in_schema_order(client: openai.OpenAI,
                                                                          mode: instructor.Mode) -> None:
    patched = instructor.from_openai(client, mode=mode)
    kwargs = dict(model="model", response_model=Worked, temperature=0, max_tokens=120, max_retries=0,
                  messages=[{"role": "user", "content": "What is 2 + 3? Think first, then answer."}])
    partials = [p.model_dump() for p in patched.chat.completions.create_partial(**kwargs)]
    reasonings = [p["reasoning"] or "" for p in partials]
    # under TOOLS the object grows with the streamed call's argument fragments, not in one piece at the end
    assert len(set(reasonings)) >= 4, reasonings
    assert all(a == b[:len(a)] for a, b in zip(reasonings, reasonings[1:]))
    first_answer = next(i for i, p in enumerate(partials) if p["answer"] is not None)
    assert reasonings[first_answer] == reasonings[-1] != ""  # the reasoning was whole before the answer began
    Worked.model_validate(partials[-1])  # the last is the whole object
