"""Ollama's API on the server, over real HTTP with the official `ollama` client and httpx, on the tiny model:
chat and generate streamed and whole, the listing routes, its options and error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import ollama
import pytest

from loopback import ServerThread, serving

MODEL = "tiny"
KEY = "sesame"
GREEDY = {"temperature": 0, "num_predict": 6}
ASK = [{"role": "user", "content": "hello there"}]
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerThread]:
    with serving(tiny_model, MODEL, kv_memory="16MiB") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def test_chat_whole_and_streamed_agree(client):
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 6 and whole.prompt_eval_count > 3
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.eval_duration > 0
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 6 and parts[-1].done_reason == "length"


def test_chat_answers_as_the_openai_endpoint_does(server, client):
    ollama_answer = client.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    openai_answer = http.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 6}).json()
    assert ollama_answer == openai_answer["choices"][0]["message"]["content"]


def test_generate_whole_streamed_and_raw(client, tiny_model):
    whole = client.generate(model=MODEL, prompt="hello", options=GREEDY)
    parts = list(client.generate(model=MODEL, prompt="hello", options=GREEDY, stream=True))
    assert whole.done and parts[-1].done and "".join(p.response for p in parts) == whole.response
    raw = client.generate(model=MODEL, prompt="hello", raw=True, options=GREEDY)
    assert raw.prompt_eval_count == len(tiny_model.tokenizer.encode("hello"))  # no template around it
    assert whole.prompt_eval_count > raw.prompt_eval_count


def test_format_holds_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 32})
    assert isinstance(json.loads(answer.message.content)["ok"], bool)


def test_the_listing_routes(server, client):
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 0 and listed.details.family == "llama"
    (loaded,) = client.ps().models
    assert loaded.model == MODEL and loaded.size > 0
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    assert http.get(server.url + "/api/version").json()["version"]
    assert client.chat(model=f"{MODEL}:latest", messages=ASK, options=GREEDY).model == f"{MODEL}:latest"


def test_errors_come_in_ollama_s_shape(server, client):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=ASK)
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    bad = http.post(server.url + "/api/chat", json={"model": MODEL, "messages": ASK, "options": {"top_p": 7}})
    assert bad.status_code == 400 and set(bad.json()) == {"error"} and "top_p" in bad.json()["error"]
    image = http.post(server.url + "/api/chat", json={"model": MODEL, "messages": [{**ASK[0], "images": ["AAAA"]}]})
    assert image.status_code == 400 and "text only" in image.json()["error"]


def test_the_api_key_guards_ollama_s_routes(tiny_model):
    with serving(tiny_model, MODEL, kv_memory="16MiB", api_key=KEY) as server:
        assert http.get(server.url + "/api/tags").status_code == 401
        keyed = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.list().models[0].model == MODEL
