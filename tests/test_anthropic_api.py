"""Anthropic's Messages API on `edgeserve serve` with the real default model, through the official client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import jsonschema
import pytest

from serve_process import ServeProcess

if TYPE_CHECKING:
    import anthropic

pytestmark = pytest.mark.slow

KEY = "test-key"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
FORCED = {"type": "tool", "name": "get_weather"}
# This client has no sampling arguments of its own: they go in the body, as the API takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(model_path) -> Iterator[ServeProcess]:
    process = ServeProcess(str(model_path), "--kv-memory", "128MiB", "--api-key", KEY)
    yield process
    process.close()


@pytest.fixture(scope="module")
def model(server: ServeProcess) -> str:
    return httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]


@pytest.fixture
def client(server: ServeProcess) -> anthropic.Anthropic:
    import anthropic  # here, not at the top: its import takes seconds of the quick loop's collection

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def test_create_answers_with_text_and_usage(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, system="You answer briefly.",
                                     messages=[{"role": "user", "content": "Name a color."},
                                               {"role": "assistant", "content": "Blue."},
                                               {"role": "user", "content": "Another one?"}])
    assert message.type == "message" and message.role == "assistant" and message.id
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and 0 < message.usage.output_tokens <= 24
    cut = client.messages.create(model=model, max_tokens=2, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    # a stop sequence the answer reaches ends it, and is named
    words = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=ASK).content[0].text.split()
    stopped = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=ASK,
                                     stop_sequences=[words[1]])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[1]
    assert words[1] not in stopped.content[0].text


def test_streamed_text_has_the_full_event_sequence(client: anthropic.Anthropic, server: ServeProcess,
                                                   model: str) -> None:
    kwargs = dict(model=model, max_tokens=20, extra_body=GREEDY, messages=ASK)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                     json={**kwargs, "stream": True}, timeout=300).text
    assert "event: ping" in raw and "event: message_delta" in raw


def test_a_streamed_tool_use_builds_its_input_from_json_fragments(client: anthropic.Anthropic, model: str) -> None:
    kwargs = dict(model=model, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER], tool_choice=FORCED)
    fragments: list[str] = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(fragments) >= 3  # written piece by piece, not whole at the end
    tool_input = json.loads("".join(fragments))
    jsonschema.validate(tool_input, WEATHER["input_schema"])
    use = final.content[-1]
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.input == tool_input and use.id
    assert not any(b.type == "text" and "<tool_call>" in b.text for b in final.content)


def test_a_tool_round_trip(client: anthropic.Anthropic, model: str) -> None:
    first = client.messages.create(model=model, max_tokens=120, messages=ASK, tools=[WEATHER], tool_choice=FORCED)
    use = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": json.dumps({"temperature_c": 21})}]}]
    second = client.messages.create(model=model, max_tokens=30, extra_body=GREEDY, messages=messages, tools=[WEATHER])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    # the call and its result are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + 20
    counted = client.messages.count_tokens(model=model, messages=messages, tools=[WEATHER])
    assert counted.input_tokens == second.usage.input_tokens


def test_count_tokens_counts_the_rendered_prompt(client: anthropic.Anthropic, model: str) -> None:
    short = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.")
    longer = client.messages.count_tokens(model=model, messages=ASK, system="Be brief. You are a weather assistant.")
    assert 10 < short.input_tokens < longer.input_tokens
    created = client.messages.create(model=model, max_tokens=1, messages=ASK, system="Be brief.")
    assert created.usage.input_tokens == short.input_tokens


def test_errors_come_in_anthropic_shape(client: anthropic.Anthropic, server: ServeProcess, model: str) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=10, messages=ASK, extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400 and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "temperature" in bad.value.body["error"][
        "message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=10, messages=ASK, tool_choice={"type": "any"})
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=10, messages=ASK)
    assert unauthorized.value.body["type"] == "error"
    assert set(unauthorized.value.body["error"]) == {"type", "message"}
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(server.url + "/v1/messages", json={"model": model, "max_tokens": 5, "messages": ASK})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=10, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    # OpenAI's paths keep OpenAI's shape
    openai_shape = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY},
                              json={"messages": ASK, "temperature": 5})
    assert openai_shape.status_code == 400 and openai_shape.json()["error"]["type"] == "invalid_request_error"
