"""Hypothesis-generated requests against a real loopback server of the tiny model: whatever a client
sends, the answer is never a 5xx, every 4xx carries an OpenAI-style error, and the server goes on
serving normal requests with no KV blocks left behind. Besides any body at all, generators of the hostile
requests the server bounds: stop strings and logprobs past their limits, grammars past llguidance's budgets,
and connections left silent or half-sent (damaged model files: bench/corrupt_gguf.py and test_model).

Each test runs FUZZ_EXAMPLES examples (10 in the quick loop, 60 in CI); set EDGESERVE_FUZZ_EXAMPLES for a
longer one, e.g. EDGESERVE_FUZZ_EXAMPLES=5000.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.server.app import create_app
from loopback import ServerThread

FUZZ_EXAMPLES = int(os.environ.get("EDGESERVE_FUZZ_EXAMPLES", "60" if "CI" in os.environ else "10"))
# A pool of 128 tokens caps every answer at the context, so the largest max_tokens or n stays quick.
POOL_BYTES = 8 * 16 * 512  # blocks x block size x the tiny model's KV bytes per token
http = httpx.Client(timeout=60)
fuzz = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize="CI" in os.environ)


@pytest.fixture(scope="module")
def url(tiny_model) -> Iterator[str]:
    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory=POOL_BYTES)))
    server = ServerThread(create_app(aengine, "tiny"))
    yield server.url
    server.stop()
    aengine.shutdown()


# values ------------------------------------------------------------------------------------------

# Valid text: any code point but a lone surrogate, and strings known to trip parsers and templates.
words = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24) | st.sampled_from(
    ["", "²", "١٢", "\x00", "0", "-1", "1e309", "NaN", "null", "<|im_end|>", "<|im_start|>user", "{", "é" * 40])
# Any text: lone surrogates too, which JSON escapes can spell.
texts = words | st.sampled_from(["\ud800", "a\udfffb"]) | st.text(st.characters(blacklist_categories=()), max_size=8)
numbers = st.one_of(
    st.integers(-3, 3), st.integers(), st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 5e-324, 1e-300, 1e308, 2.0000001, 0.9999999, 64, 65]))
_MISSING = object()  # a field left out
anything = st.recursive(st.none() | st.booleans() | numbers | texts,
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                        max_leaves=10)


def edgy_floats(low: float, high: float) -> st.SearchStrategy:
    """Floats in [low, high], their ends and the tiniest positive ones often."""
    return st.floats(low, high) | st.sampled_from([low, high, 5e-324, 1e-320, 1e-300]).filter(lambda x: low <= x <= high)


token_ids = st.integers(0, 98) | st.integers(-5, 120) | st.integers()
part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": words | st.lists(part, max_size=3)},
                                optional={"name": words})
tool_call = st.fixed_dictionaries({"id": words, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"]), "arguments": st.sampled_from(["{}", '{"city": "Paris"}', "[", ""])})})
tool_turns = st.tuples(tool_call, words).map(lambda call_result: [
    {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call_result[0]]},
    {"role": "tool", "tool_call_id": call_result[0]["id"], "content": call_result[1]}])
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather"])},
    optional={"description": words, "parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}})})})
schemas = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer"},
                           {"enum": ["a", "b"]}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}])

# Each field's well-formed values; bodies() also puts anything at all in one of them.
SAMPLING_FIELDS = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 6),
    "temperature": edgy_floats(0, 2),
    "top_p": edgy_floats(0, 1),
    "top_k": st.integers(0, 100),
    "min_p": edgy_floats(0, 1),
    "repetition_penalty": edgy_floats(5e-324, 3),
    "presence_penalty": edgy_floats(-2, 2),
    "frequency_penalty": edgy_floats(-2, 2),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": words | st.lists(words, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.integers(0, 98).map(str), edgy_floats(-100, 100), max_size=3),
    "user": words,
    "ignore_eos": st.booleans(),
    "guided_regex": st.sampled_from(["[ab]{1,3}", "(", "a*", "[0-9]+x"]),
    "guided_json": schemas,
    "guided_grammar": st.sampled_from(['start: "a" | "b"', "start: ", "start: /[xy]+/"]),
    "unknown_field": anything,
}
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": st.lists(message, min_size=1, max_size=3) | tool_turns,
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.just({"type": "function", "function": {"name": "f"}}),
    "parallel_tool_calls": st.booleans(),
    "functions": st.none(),  # the legacy field: anything but null is refused
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": words | st.lists(words, min_size=1, max_size=3) | st.lists(token_ids, min_size=1, max_size=8)
    | st.lists(st.lists(token_ids, min_size=1, max_size=5), min_size=1, max_size=3),
    "logprobs": st.integers(0, 20),
    "echo": st.just(False),
}


@st.composite
def spoiled(draw: st.DrawFn, valid: st.SearchStrategy) -> object:
    """A well-formed body with one value at any depth made anything at all, or left out."""
    body = copy.deepcopy(draw(valid))  # strategies like st.just hand out the same object each time
    node = body
    while node:
        key = draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        if isinstance(node[key], dict | list) and node[key] and draw(st.booleans()):
            node = node[key]  # deeper
            continue
        value = draw(anything | st.just(_MISSING))
        if value is _MISSING:
            del node[key]
        else:
            node[key] = value
        break
    return body


def bodies(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy:
    """Well-formed bodies with a few of the fields, the same spoiled somewhere, or anything at all."""
    optional = sorted(k for k in fields if k != required)
    valid = st.lists(st.sampled_from(optional), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in (required, *keys)}))
    return st.one_of(valid, valid, spoiled(valid), anything)


# checks ------------------------------------------------------------------------------------------

def check(resp: httpx.Response, sent: bytes) -> None:
    """Never a 5xx, and a 4xx is an OpenAI-style error."""
    event(f"HTTP {resp.status_code}")  # the spread shows with --hypothesis-show-statistics
    assert resp.status_code < 500, (resp.status_code, resp.text, sent)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (resp.text, sent)
        assert isinstance(error["type"], str)


def post(url: str, path: str, body: object) -> None:
    """Send a body to a generation endpoint: check's rules, and a 200 is whole (a stream ends with [DONE])."""
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    resp = http.post(url + path, content=raw, headers={"Content-Type": "application/json"})
    check(resp, raw)
    if resp.status_code != 200:
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (resp.text, raw)
        for event in events[:-1]:
            assert "error" not in json.loads(event), (event, raw)
    else:
        assert resp.json()["choices"], (resp.text, raw)


# the fuzz ----------------------------------------------------------------------------------------

@fuzz
@given(body=bodies(CHAT_FIELDS, "messages"))
def test_fuzz_chat_completions(url, body):
    post(url, "/v1/chat/completions", body)


@fuzz
@given(body=bodies(COMPLETION_FIELDS, "prompt"))
# Found by this fuzz: a tiny repetition penalty lifted the logits a grammar forbids, so the output
# left its grammar (a 500).
@example(body={"prompt": "jj", "repetition_penalty": 1.2e-247, "guided_json": {"type": "object"}})
def test_fuzz_completions(url, body):
    post(url, "/v1/completions", body)


@fuzz
@given(raw=st.binary(max_size=64) | texts.map(lambda t: t.encode("utf-8", "surrogatepass")),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_raw_bodies(url, raw, path):
    post(url, path, raw)


@fuzz
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
       path=st.sampled_from(["/v1/models", "/v1/edgeserve/kv", "/health", "/metrics", "/v1/chat/completions",
                             "/v1/completions", "/v1/embeddings", "/v1/", "/"]) | texts.map(lambda t: "/v1/" + t),
       query=st.dictionaries(texts, texts, max_size=2))
def test_fuzz_paths_and_methods(url, method, path, query):
    try:
        request = http.build_request(method, url + path, params=query)
    except (httpx.InvalidURL, UnicodeEncodeError):
        return  # a URL no client can send
    check(http.send(request), f"{method} {path}".encode("utf-8", "surrogatepass"))


# the hostile requests the reliability work bounded ----------------------------------------------

# stop strings past their limits (16 of 1,000 characters) as often as within them
stops = (st.lists(st.text(max_size=3), min_size=12, max_size=40)
         | st.text(min_size=995, max_size=1005).map(lambda t: [t]) | st.lists(words, max_size=4))
# grammars that validate but that llguidance cannot follow (a 400 when compiled), beside ones it can
budget_grammars = st.one_of(
    st.fixed_dictionaries({"guided_json": st.sampled_from([
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}, "required": ["p0"]},
        {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}])}),
    st.fixed_dictionaries({"guided_regex": st.sampled_from(["(a|b){1,40}c", "[0-9]{1,300}", "((ab)*c)*", "x{0,64}"])}),
    st.fixed_dictionaries({"guided_grammar": st.integers(1, 3000).map(
        lambda n: "start: " + " | ".join(f'"w{i}"' for i in range(n)))}))


@fuzz
@given(prompt=words, n=st.integers(1, 8) | st.integers(100, 300), max_tokens=st.integers(1, 6),
       logprobs=st.integers(-2, 30), stop=stops, stream=st.booleans())
def test_fuzz_stop_strings_and_logprobs(url, prompt, n, max_tokens, logprobs, stop, stream):
    post(url, "/v1/completions", {"prompt": prompt, "n": n, "max_tokens": max_tokens, "logprobs": logprobs,
                                  "stop": stop, "stream": stream})


@fuzz
@given(grammar=budget_grammars, max_tokens=st.integers(1, 6), stream=st.booleans())
def test_fuzz_grammar_budgets(url, grammar, max_tokens, stream):
    post(url, "/v1/completions", {"prompt": "x", "max_tokens": max_tokens, "stream": stream, **grammar})


@pytest.fixture(scope="module")
def guarded_url(tiny_model) -> Iterator[str]:
    """A server with `edgeserve serve`'s connection handling (silent sockets closed, a connection limit)."""
    import socket
    import threading

    import uvicorn

    from edgeserve.server.connections import IdleClosingH11

    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory=POOL_BYTES)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(aengine, "tiny"), log_level="warning", http=IdleClosingH11,
                                           timeout_keep_alive=0.25, limit_concurrency=48))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    aengine.shutdown()


REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: 40\r\n\r\n" + b'{"prompt": "hi", "max_tokens": 2}      ')


@fuzz
@given(held=st.lists(st.integers(0, len(REQUEST) - 1).map(lambda cut: REQUEST[:cut]) | st.binary(max_size=40),
                     min_size=1, max_size=40))
def test_fuzz_idle_and_half_sent_connections(guarded_url, held):
    """Connections that go silent before, inside or after a request's head: while they are held, a new client is
    answered (or told 503 past the connection limit, never left hanging), and each held one is closed in time."""
    import socket

    host, port = guarded_url.removeprefix("http://").split(":")
    sockets = []
    try:
        for data in held:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(data)
            sockets.append(s)
        # a new connection: a kept-alive one of the shared client may be closed by the server's idle timer
        # just as it is reused (a race every keep-alive client meets, and retries)
        check(httpx.get(guarded_url + "/health", timeout=5), b"GET /health")
        deadline = time.monotonic() + 5
        for s in sockets:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            while s.recv(65536):  # an error answer to garbage may come first; then the close
                pass
    finally:
        for s in sockets:
            s.close()


def test_the_server_still_serves_after_the_fuzz(url):
    """Runs last: whatever came before, a normal request is answered and no request or block is left over."""
    resp = http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    health = http.get(url + "/health").json()
    assert health["status"] == "ok" and health["running"] == health["waiting"] == 0
    counts = http.get(url + "/v1/edgeserve/kv").json()["counts"]
    assert counts["used"] == counts["shared"] == 0
