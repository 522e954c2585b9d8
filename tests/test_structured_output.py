"""Structured output and tool calls on the real default model, over real HTTP with the official client.

The model is small and its answers poor, but whatever it says under a grammar must validate.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.server.app import create_app
from loopback import ServerThread


def _object(**properties: dict) -> dict:
    """A closed object with every property required (as OpenAI's strict mode has them)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "nested": _object(person=_object(name=SHORT, address=_object(city=SHORT, zip={"type": "string",
                                                                                  "pattern": "^[0-9]{5}$"}))),
    "array": _object(scores={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                             "minItems": 2, "maxItems": 4}),
    "enum_bool": _object(color={"enum": ["red", "green", "blue"]}, bright={"type": "boolean"}),
    "nullable": _object(nickname={"anyOf": [SHORT, {"type": "null"}]},
                        age={"type": "integer", "minimum": 0, "maximum": 130}),
    "pattern": _object(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, count={"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}),
    "list_of_objects": _object(items={"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": _object(name=SHORT, qty={"type": "integer", "minimum": 1,
                                                                        "maximum": 99})}),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": _object(city=SHORT, unit={"enum": ["celsius", "fahrenheit"]})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone", "parameters": _object(zone=SHORT)}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(loaded_model) -> Iterator[ServerThread]:
    aengine = AsyncEngine(LLMEngine(loaded_model, EngineConfig(backend="numpy", kv_memory="256MiB")))
    thread = ServerThread(create_app(aengine, "model"))
    yield thread
    thread.stop()
    aengine.shutdown()


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_calls(calls: list, names: set[str]) -> None:
    """Each call names one of `names`, has an id, and its arguments follow the function's schema."""
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_gives_json_that_validates(client: openai.OpenAI, temperature: float) -> None:
    def ask(item: tuple[str, dict]):
        name, schema = item
        messages = [{"role": "user", "content": f"Reply with a JSON object ({name.replace('_', ' ')})."}]
        return client.chat.completions.create(model="model", messages=messages, temperature=temperature, seed=7,
                                              max_tokens=400, response_format=json_format(name, schema))

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: constrained rows share the batched steps
        replies = list(pool.map(ask, SCHEMAS.items()))
    for (name, schema), reply in zip(SCHEMAS.items(), replies):
        assert reply.choices[0].finish_reason == "stop", name  # the grammar ended it, not the length limit
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_streamed_json_schema_validates_and_equals_the_whole_answer(client: openai.OpenAI) -> None:
    schema = SCHEMAS["nested"]
    kwargs = dict(model="model", messages=[{"role": "user", "content": "Who lives where? Answer in JSON."}],
                  temperature=0, max_tokens=300, response_format=json_format("person", schema))
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert client.chat.completions.create(**kwargs).choices[0].message.content == text


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=30)
    country_code: str = pydantic.Field(pattern="^[A-Z]{2}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    home: Address
    languages: list[str] = pydantic.Field(min_length=1, max_length=3)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(model="model", messages=[{"role": "user", "content": "Describe a person."}],
                                          response_format=Person, temperature=0, max_tokens=300)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and 1 <= len(person.languages) <= 3


def test_json_object_gives_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "A fruit, in JSON."}],
                                           response_format={"type": "json_object"}, temperature=1.0, seed=3,
                                           max_tokens=300)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_regex_and_lark_grammars_on_both_endpoints(client: openai.OpenAI) -> None:
    regex = r"(yes|no), because [a-z ]{3,40}\."
    completion = client.completions.create(model="model", prompt="Is the sky blue? Answer:", max_tokens=60,
                                           temperature=1.0, seed=1, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
    reply = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Is water wet?"}],
                                           max_tokens=60, temperature=0, extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", reply.choices[0].message.content)
    schema = SCHEMAS["enum_bool"]
    completion = client.completions.create(model="model", prompt="A color as JSON:", max_tokens=60, temperature=0,
                                           extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": json_format("bad", {"type": "no-such-type"})}, "response_format"),
    ({"extra_body": {"guided_regex": "a[b"}}, "guided_regex"),
    ({"extra_body": {"guided_regex": "x" * 200_001}}, "guided_regex"),  # too long to compile
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "a", "guided_grammar": 'start: "a"'}}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"extra_body": {"function_call": "auto"}}, "function_call"),
    ({"extra_body": {"modalities": ["text", "audio"]}}, "modalities"),
])
def test_bad_grammars_and_unsupported_fields_are_400s_naming_the_parameter(client: openai.OpenAI, body: dict,
                                                                           param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="model", messages=ASK, max_tokens=5, **body)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    # and the server goes on serving
    assert client.chat.completions.create(model="model", messages=ASK, max_tokens=2).choices[0].message.content


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_calls_tools_with_valid_arguments(client: openai.OpenAI, temperature: float) -> None:
    reply = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=temperature, seed=5, max_tokens=300)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message.tool_calls, {"get_weather", "get_time"})
    single = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=temperature, seed=5,
                                            max_tokens=300)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    check_calls(calls, {"get_time"})


def test_none_and_auto_tool_choices(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="model", messages=ASK, max_tokens=24, temperature=0)
    none = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=24, temperature=0)
    auto = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, max_tokens=300, temperature=0)
    # none: the model does not see the tools and answers as without them
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls
    # auto: it sees them, and whatever it chooses comes back well formed
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens
    message = auto.choices[0].message
    if message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        check_calls(message.tool_calls, {"get_weather", "get_time"})
    else:
        assert message.content and "<tool_call>" not in message.content


def test_streamed_tool_calls_assemble_in_the_official_client(client: openai.OpenAI) -> None:
    kwargs = dict(model="model", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_calls(final.message.tool_calls, {"get_weather", "get_time"})
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)  # no markup leaks as content


def test_a_full_tool_round_trip(client: openai.OpenAI) -> None:
    messages = list(ASK)
    first = client.chat.completions.create(model="model", messages=messages, tools=TOOLS, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    second = client.chat.completions.create(model="model", messages=messages, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    # the call and its result are in the prompt: it grew by them
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    without_result = client.chat.completions.create(model="model", messages=messages[:-1], tools=TOOLS,
                                                    max_tokens=1)
    assert second.usage.prompt_tokens > without_result.usage.prompt_tokens



@pytest.mark.parametrize("extra", [
    {"guided_regex": "a{1000000}"},  # valid, but past the lexer's budget
    {"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
])
def test_a_grammar_past_llguidance_s_budgets_is_a_400_naming_it(client: openai.OpenAI, extra: dict) -> None:
    """Grammars that validate but that llguidance cannot follow are refused when compiled, naming the parameter
    and why (without llguidance's state dump), not admitted to fail or end empty as if done."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="model", messages=ASK, max_tokens=5, extra_body=extra)
    body = refused.value.body
    assert body["param"] == next(iter(extra)) and "grammar engine" in body["message"]
    assert "<state>" not in body["message"]
    assert client.chat.completions.create(model="model", messages=ASK, max_tokens=2).choices[0].message.content
