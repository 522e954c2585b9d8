"""Anthropic's Messages API and OpenAI's Responses API on the tiny random model: their shapes, event sequences, keys
and errors, over real HTTP. A forced tool call keeps the random model's answer a valid call."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from loopback import serving

KEY = "secret"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tiny_model) -> Iterator[str]:
    with serving(tiny_model, "tiny", kv_memory="16MiB", api_key=KEY) as server:
        yield server.url


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"x-api-key": KEY} if headers is None else headers, timeout=60)


def sse_events(text: str) -> list[tuple[str | None, dict]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines.get("event"), json.loads(lines["data"])))
    return events


# A character tokenizer spells the call markup token by token: room for it.
MESSAGE = {"model": "tiny", "max_tokens": 200, "messages": ASK,
           "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}


def test_a_message_streams_its_tool_use_in_anthropic_events(url: str) -> None:
    events = sse_events(post(url, "/v1/messages", {**MESSAGE, "stream": True}).text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    start = next(data for name, data in events if name == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["name"] == "get_weather"
    fragments = [d["delta"]["partial_json"] for n, d in events
                 if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    jsonschema.validate(json.loads("".join(fragments)), SCHEMA)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] > 0
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0


def test_a_message_body_holds_its_blocks(url: str) -> None:
    body = post(url, "/v1/messages", MESSAGE).json()
    assert body["type"] == "message" and body["role"] == "assistant" and body["stop_reason"] == "tool_use"
    use = body["content"][-1]
    assert use["type"] == "tool_use" and use["id"] and use["name"] == "get_weather"
    jsonschema.validate(use["input"], SCHEMA)
    text = post(url, "/v1/messages", {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": ASK}).json()
    assert text["stop_reason"] == "max_tokens" and text["usage"]["output_tokens"] == 5
    assert post(url, "/v1/messages/count_tokens", {"model": "tiny", "messages": ASK}).json()["input_tokens"] == \
        text["usage"]["input_tokens"]


def test_keys_and_errors_in_each_api_s_shape(url: str) -> None:
    assert post(url, "/v1/messages", MESSAGE, {"authorization": f"Bearer {KEY}"}).status_code == 200
    unauthorized = post(url, "/v1/messages", MESSAGE, {})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["type"] == "error" and unauthorized.json()["error"]["type"] == "authentication_error"
    for bad in ({"max_tokens": 0}, {"messages": []}, {"temperature": 2}, {"tool_choice": {"type": "tool"}},
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}):
        response = post(url, "/v1/messages", {**MESSAGE, **bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["type"] == "invalid_request_error"
    # OpenAI's paths keep OpenAI's shape, and take the Anthropic header too
    openai_error = post(url, "/v1/responses", {"input": "hi", "max_output_tokens": 0})
    assert openai_error.status_code == 400 and openai_error.json()["error"]["type"] == "invalid_request_error"
    assert post(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, {}).status_code == 401


RESPONSE = {"model": "tiny", "input": "Weather in Paris?", "max_output_tokens": 200,
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}], "tool_choice": "required",
            "parallel_tool_calls": False}


def test_a_response_streams_its_function_call_in_responses_events(url: str) -> None:
    events = sse_events(post(url, "/v1/responses", {**RESPONSE, "stream": True}).text)
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-2:] == ["response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    done = next(d for n, d in events if n == "response.function_call_arguments.done")
    assert deltas == done["arguments"]
    jsonschema.validate(json.loads(deltas), SCHEMA)
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][-1]["arguments"] == deltas
    assert final["output"][-1]["id"] == events[2][1]["item"]["id"]  # the item keeps its id from added to done
    stored = httpx.get(f"{url}/v1/responses/{final['id']}", headers={"x-api-key": KEY}).json()
    assert stored["output"] == final["output"]


def test_a_response_chains_on_its_previous_one(url: str) -> None:
    first = post(url, "/v1/responses", RESPONSE).json()
    call = first["output"][-1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}
    chained = post(url, "/v1/responses", {"model": "tiny", "input": [output], "max_output_tokens": 3,
                                          "previous_response_id": first["id"]}).json()
    items = [{"role": "user", "content": "Weather in Paris?"}, call, output]
    whole = post(url, "/v1/responses", {"model": "tiny", "max_output_tokens": 3, "input": items}).json()
    alone = post(url, "/v1/responses", {"model": "tiny", "max_output_tokens": 3, "input": "Weather in Paris?"}).json()
    # the previous input, its call and the call's output are all in the prompt
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 20
    assert chained["previous_response_id"] == first["id"]
    missing = post(url, "/v1/responses", {"input": "hi", "previous_response_id": "resp-gone"})
    assert missing.status_code == 404 and "previous_response_id" == missing.json()["error"]["param"]


# A template that opens the answer's reasoning section, as Qwen 3's and DeepSeek-R1's do.
REASONING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def reasoning_url(tiny_model) -> Iterator[str]:
    tokenizer = copy.copy(tiny_model.tokenizer)
    tokenizer.chat_template = REASONING_TEMPLATE
    with serving(dataclasses.replace(tiny_model, tokenizer=tokenizer), "tiny", kv_memory="16MiB") as server:
        yield server.url


def test_a_grammar_binds_after_the_reasoning_section_the_prompt_opened(reasoning_url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    reply = post(reasoning_url, "/v1/chat/completions",
                 {"messages": ASK, "max_tokens": 12, "response_format": fmt, "temperature": 0}, {}).json()
    message = reply["choices"][0]["message"]
    # the random model reasons on, its thoughts free as without the format (the grammar waits for their end),
    # and they come apart, not as content
    free = post(reasoning_url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, "temperature": 0}, {})
    assert reply["choices"][0]["finish_reason"] == "length" and not message["content"]
    thought, free_thought = message["reasoning_content"], free.json()["choices"][0]["message"]["reasoning_content"]
    # (the grammar still rules out special tokens, which the free answer may pick later on)
    assert len(thought) >= 10 and thought[:4] == free_thought[:4] and not thought.startswith("{")
    inline = post(reasoning_url, "/v1/chat/completions",
                  {"messages": ASK, "max_tokens": 12, "temperature": 0, "reasoning_format": "none"}, {}).json()
    assert inline["choices"][0]["message"]["content"] and "reasoning_content" not in inline["choices"][0]["message"]
