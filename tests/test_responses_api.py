"""OpenAI's Responses API on the real default model, over real HTTP with the official client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from loopback import serving

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris right now?"
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(loaded_model) -> Iterator[openai.OpenAI]:
    with serving(loaded_model, "model") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_create_answers_and_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(model="model", input="Name a color.", instructions="Answer in one word.",
                                       max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text.strip()
    assert response.usage.input_tokens > 5 and 0 < response.usage.output_tokens <= 16
    assert response.instructions == "Answer in one word."
    assert client.responses.retrieve(response.id).output_text == response.output_text
    cut = client.responses.create(model="model", input=ASK, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[-1].status == "incomplete"  # the message it cut, too
    unstored = client.responses.create(model="model", input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="model", input="My name is Ada.", max_output_tokens=20, temperature=0)
    second = client.responses.create(model="model", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    alone = client.responses.create(model="model", input="What is my name?", max_output_tokens=8, temperature=0)
    # the first turn and its answer are in the prompt
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="model", input="hi", previous_response_id="resp-unknown")


def test_stream_sends_the_event_sequence_and_the_same_text(client: openai.OpenAI) -> None:
    kwargs = dict(model="model", input=ASK, max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    # cut at its length, as OpenAI ends such a response: incomplete (get_final_response wants a completed one)
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text


def test_a_streamed_function_call_arrives_in_argument_fragments(client: openai.OpenAI) -> None:
    kwargs = dict(model="model", input=ASK, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=120,
                  temperature=0)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) >= 3 and "".join(deltas) == done.arguments
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.arguments == done.arguments


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model="model", input=ASK, tools=[WEATHER], tool_choice=FORCED,
                                    max_output_tokens=120)
    call = next(item for item in first.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 21})}]
    second = client.responses.create(model="model", input=items, tools=[WEATHER], max_output_tokens=30,
                                     temperature=0)
    assert second.output and second.usage.input_tokens > first.usage.input_tokens + 20
    # the same through previous_response_id: only the output goes up
    chained = client.responses.create(model="model", previous_response_id=first.id, tools=[WEATHER],
                                      max_output_tokens=30, temperature=0, input=[items[-1]])
    assert chained.usage.input_tokens == second.usage.input_tokens


class Answer(pydantic.BaseModel):
    reasoning: str = pydantic.Field(max_length=80)
    answer: int


def test_parse_fills_a_pydantic_model_in_its_field_order(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="model", input="What is 2 + 3?", text_format=Answer,
                                    max_output_tokens=120, temperature=0)
    assert isinstance(parsed.output_parsed, Answer)
    assert list(json.loads(parsed.output_text)) == ["reasoning", "answer"]


def test_bad_requests_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="model", input=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="model", input=[{"type": "item_reference", "id": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="model", input=ASK, max_output_tokens=0)
