"""The OpenAI-compatible server over real HTTP on loopback, with the official clients.

The tiny random model serves most of the module: the main server, and a small second one with an
API key and a queue limit of 2, both on the same AsyncEngine. The tests whose assertions need real
text (what the model says, the catalog name of its file) run on a server of the real model.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest
from click.testing import CliRunner

from edgeserve.bench.http_driver import run_http_bench
from edgeserve.bench.workloads import BenchRequest
from edgeserve.cli.main import cli
from edgeserve.cli.serve_cmd import served_model_name
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.server.app import create_app
from loopback import ServerThread

API_KEY = "test-key-123"
# Generous: on a busy machine an engine step, and so /v1/edgeserve/kv, can take seconds.
http = httpx.Client(timeout=60)
IGNORE_EOS = {"ignore_eos": True}  # an extension (vLLM and llama.cpp have it too): fixed output lengths


@pytest.fixture(scope="module")
def engine(tiny_model) -> Iterator[AsyncEngine]:
    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    yield aengine
    aengine.shutdown()


@pytest.fixture(scope="module")
def model_name(tiny_model) -> str:
    return served_model_name(str(tiny_model.source))


@pytest.fixture(scope="module")
def main_server(engine: AsyncEngine, model_name: str) -> Iterator[ServerThread]:
    server = ServerThread(create_app(engine, model_name))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def url(main_server: ServerThread) -> str:
    return main_server.url


@pytest.fixture(scope="module")
def keyed_url(engine: AsyncEngine, model_name: str) -> Iterator[str]:
    server = ServerThread(create_app(engine, model_name, api_key=API_KEY, max_queue=4))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def real_server(loaded_model, real_model_name: str) -> Iterator[ServerThread]:
    """A server of the real model, for the tests about what it says."""
    aengine = AsyncEngine(LLMEngine(loaded_model, EngineConfig(backend="numpy", kv_memory="256MiB")))
    server = ServerThread(create_app(aengine, real_model_name))
    yield server
    server.stop()
    aengine.shutdown()


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def real_model_name(model_path) -> str:
    return served_model_name(str(model_path))


@pytest.fixture
def real_client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def kv_owners(url: str) -> set[str]:
    """Request ids holding KV blocks."""
    return {o for b in http.get(url + "/v1/edgeserve/kv").json()["blocks"] for o in b["owners"]}


def metric(url: str, name: str, default: float | None = None) -> float:
    """The value of one sample line of /metrics, e.g. 'edgeserve_kv_blocks{state="used"}'."""
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    if default is None:
        raise AssertionError(f"{name} not in /metrics")
    return default


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def no_blocks_in_use(url: str) -> bool:
    return (metric(url, 'edgeserve_kv_blocks{state="used"}') == 0
            and metric(url, "edgeserve_requests_running") == 0 and metric(url, "edgeserve_requests_waiting") == 0)


# the API with the official client -------------------------------------------------


def test_models_and_names(client: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in client.models.list().data] == [model_name]
    out = client.chat.completions.create(model=model_name, messages=chat("Hi"), max_tokens=2, temperature=0)
    assert out.model == model_name and out.usage.completion_tokens >= 1


def test_the_catalog_name_of_the_served_file_is_accepted(real_client: openai.OpenAI, real_model_name: str) -> None:
    assert DEFAULT_MODEL != real_model_name  # served as its file's name, asked for by its catalog name
    out = real_client.chat.completions.create(model=DEFAULT_MODEL, messages=chat("Hi"), max_tokens=2, temperature=0)
    assert out.model == DEFAULT_MODEL and out.usage.completion_tokens >= 1  # answered under the name asked for


def test_chat_usage_and_logprobs_match_the_tokenizer(real_client: openai.OpenAI, real_server: ServerThread,
                                                     real_model_name: str) -> None:
    aengine = real_server.app.state.server.models.default.model.aengine
    messages = chat("Name three colors.")
    out = real_client.chat.completions.create(model=real_model_name, messages=messages, max_completion_tokens=10,
                                              temperature=0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert out.usage.prompt_tokens == len(aengine.prompts.chat(messages))
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10
    assert len(aengine.tokenizer.encode(choice.message.content, add_bos=False)) == 10
    content = choice.logprobs.content
    assert len(content) == 10
    assert "".join(t.token for t in content) == choice.message.content
    for tok in content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert tok.top_logprobs[0].token == tok.token and tok.logprob == pytest.approx(tops[0])  # greedy
        assert bytes(tok.bytes).decode() == tok.token


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, messages=chat("What is the capital of France?"), max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_prompt_batch_n_and_logprobs(client: openai.OpenAI, engine: AsyncEngine,
                                                 model_name: str) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    out = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                    logprobs=2, extra_body=IGNORE_EOS)
    assert out.object == "text_completion" and [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * 6
    assert out.choices[0].text == out.choices[1].text  # greedy: both choices of a prompt agree
    for c in out.choices:
        lp = c.logprobs
        assert c.finish_reason == "length" and len(lp.tokens) == 6 and "".join(lp.tokens) == c.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
        assert all(len(top) <= 2 and max(top.values()) == pytest.approx(p)
                   for top, p in zip(lp.top_logprobs, lp.token_logprobs))
    by_ids = client.completions.create(model=model_name, prompt=engine.tokenizer.encode(prompts[0]), max_tokens=6,
                                       temperature=0, extra_body=IGNORE_EOS)
    assert by_ids.choices[0].text == out.choices[0].text


def test_completions_stream(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings(real_client: openai.OpenAI, real_model_name: str) -> None:
    kwargs = dict(model=real_model_name, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    free = real_client.completions.create(**kwargs).choices[0].text
    assert " 6" in free
    stopped = real_client.completions.create(**kwargs, stop=[" 6", "never"]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(" 6")]
    streamed = real_client.completions.create(**kwargs, stop=" 6", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_penalties_reach_the_sampler(real_client: openai.OpenAI, real_model_name: str) -> None:
    kwargs = dict(model=real_model_name, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, extra_body=IGNORE_EOS)
    plain = real_client.completions.create(**kwargs).choices[0].text
    assert plain.startswith(" 5, 6, 7,")
    # The repeated ", " loses to another token once penalised for each use.
    assert not real_client.completions.create(**kwargs, frequency_penalty=2.0).choices[0].text.startswith(" 5, 6, 7,")


def test_logit_bias(client: openai.OpenAI, engine: AsyncEngine, model_name: str) -> None:
    tok = engine.tokenizer
    kwargs = dict(model=model_name, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, extra_body=IGNORE_EOS)
    first = tok.encode(client.completions.create(**kwargs).choices[0].text, add_bos=False)[0]
    banned = client.completions.create(**kwargs, logit_bias={str(first): -100}).choices[0].text
    assert tok.encode(banned, add_bos=False)[0] != first
    b = tok.encode("b", add_bos=False)[0]
    forced = client.completions.create(**kwargs, logit_bias={str(b): 100}).choices[0].text
    assert forced == "bbbb"


def test_seed_and_n(client: openai.OpenAI, model_name: str) -> None:
    kwargs = dict(model=model_name, messages=chat("Tell me a story."), max_tokens=8, temperature=1.0, n=3)
    first = client.chat.completions.create(**kwargs, seed=1234)
    again = client.chat.completions.create(**kwargs, seed=1234)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice draws with its own seed


async def test_async_client_chat_and_text(aclient: openai.AsyncOpenAI, client: openai.OpenAI,
                                          model_name: str) -> None:
    kwargs = dict(model=model_name, messages=chat("Say hello."), max_tokens=8, temperature=0)
    whole = await aclient.chat.completions.create(**kwargs)
    stream = await aclient.chat.completions.create(**kwargs, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    sync = client.chat.completions.create(**kwargs)
    assert text == whole.choices[0].message.content == sync.choices[0].message.content
    done = await aclient.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=5,
                                            temperature=0, extra_body=IGNORE_EOS)
    stream = await aclient.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=5,
                                              temperature=0, extra_body=IGNORE_EOS, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == done.choices[0].text
    assert done.usage.completion_tokens == 5


# many clients, disconnects ----------------------------------------------------


async def _stream_text(aclient: openai.AsyncOpenAI, model_name: str, content: str, max_tokens: int) -> str:
    stream = await aclient.chat.completions.create(model=model_name, messages=chat(content), max_tokens=max_tokens,
                                                   temperature=0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream])


async def test_16_concurrent_streams_match_each_alone(aclient: openai.AsyncOpenAI, url: str,
                                                      model_name: str) -> None:
    # 8 prompts, each sent by two of the clients: the duplicates share prefix-cached blocks.
    topics = ["cats", "rain", "the sea", "bread", "music", "trains", "snow", "owls"]
    prompts = [f"Write one sentence about {t}." for t in topics]
    alone = {p: await _stream_text(aclient, model_name, p, 8) for p in prompts}
    clients = prompts * 2
    together = await asyncio.gather(*(_stream_text(aclient, model_name, p, 8) for p in clients))
    assert list(together) == [alone[p] for p in clients]
    assert len(set(alone.values())) == len(prompts)
    wait_until(lambda: no_blocks_in_use(url))
    assert metric(url, 'edgeserve_kv_blocks{state="free"}') + metric(url, 'edgeserve_kv_blocks{state="cached"}') \
        == metric(url, "edgeserve_kv_blocks_total")


async def test_disconnect_frees_blocks_and_spares_others(aclient: openai.AsyncOpenAI, url: str,
                                                         model_name: str) -> None:
    messages = chat("Count slowly from one to one thousand.")
    other_alone = await _stream_text(aclient, model_name, "Describe a sunny day.", 8)
    other = asyncio.create_task(_stream_text(aclient, model_name, "Describe a sunny day.", 8))
    stream = await aclient.chat.completions.create(model=model_name, messages=messages, max_tokens=2000,
                                                   temperature=0, extra_body=IGNORE_EOS, stream=True)
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices[0].delta.content)
        if seen == 4:
            break
    assert any(o.startswith(chunk.id) for o in kv_owners(url))  # still running: it holds blocks
    await stream.close()
    # Left alone it would run for 2000 tokens; aborted, its blocks go back at once.
    wait_until(lambda: not any(o.startswith(chunk.id) for o in kv_owners(url)))
    assert await other == other_alone
    wait_until(lambda: no_blocks_in_use(url))
    assert metric(url, 'edgeserve_generations_total{reason="disconnect"}') >= 1


def test_hanging_up_on_a_non_streaming_request_aborts_it(url: str, model_name: str) -> None:
    body = json.dumps({"model": model_name, "messages": chat("Count to a thousand."), "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    disconnects = 'edgeserve_generations_total{reason="disconnect"}'
    before = metric(url, disconnects, default=0)
    with socket.create_connection(("127.0.0.1", urlparse(url).port)) as conn:
        conn.sendall(head + body)
        wait_until(lambda: metric(url, "edgeserve_requests_running") == 1)
    # Left alone it would run for 2000 tokens.
    wait_until(lambda: no_blocks_in_use(url))
    wait_until(lambda: metric(url, disconnects, default=0) == before + 1)


def test_shutdown_ends_open_streams(main_server: ServerThread, client: openai.OpenAI, model_name: str) -> None:
    stream = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=2000,
                                       extra_body=IGNORE_EOS, stream=True)
    first = next(iter(stream))
    main_server.app.state.server.abort_all()  # what Ctrl-C on `edgeserve serve` does before stopping
    rest = list(stream)  # ends: the server closed it with [DONE]
    assert [c.choices[0].finish_reason for c in [first, *rest]][-1] == "abort"
    assert len(rest) < 100
    wait_until(lambda: no_blocks_in_use(main_server.url))


# bad input, limits, keys ------------------------------------------------------

GOOD_CHAT = {"messages": chat("hi"), "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "0.5"}, 400, "temperature", "invalid_type"),
    ("/v1/chat/completions", {**GOOD_CHAT, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"five": -100}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"5": -101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "logit_bias": {"99999999": 5}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "invalid_value"),
    # Longer than the context: 400 with OpenAI's code for it, as OpenAI answers.
    ("/v1/completions", {"prompt": [42] * 9000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/nowhere", {}, 404, None, "not_found"),
])
def test_bad_input(url: str, path: str, body: dict | bytes, status: int, param: str | None, code: str) -> None:
    content = body if isinstance(body, bytes) else None
    resp = http.post(url + path, content=content, json=None if content else body,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and error["message"]
    assert http.get(url + "/health").json()["status"] == "ok"


def test_bad_input_through_the_client(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=chat("hi"))
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name, messages=[], max_tokens=2)
    assert bad.value.param == "messages"
    ok = client.chat.completions.create(model=model_name, messages=chat("hi"), max_tokens=2)  # still serving
    assert ok.choices[0].message.role == "assistant"


def test_api_key(keyed_url: str, model_name: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = http.get(keyed_url + "/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=keyed_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model_name, messages=chat("hi"), max_tokens=2)
    right = openai.OpenAI(base_url=keyed_url + "/v1", api_key=API_KEY, max_retries=0)
    assert right.chat.completions.create(model=model_name, messages=chat("hi"), max_tokens=2).choices
    assert http.get(keyed_url + "/health").status_code == 200  # health stays open for probes
    assert http.get(keyed_url + "/metrics").status_code == 401


def test_full_queue_gets_429_and_others_carry_on(keyed_url: str, model_name: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    greedy_share = http.post(keyed_url + "/v1/chat/completions", headers=headers, json={**GOOD_CHAT, "n": 3})
    assert greedy_share.status_code == 400 and greedy_share.json()["error"]["param"] == "n"  # over half the queue
    client = openai.OpenAI(base_url=keyed_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    streams = [client.chat.completions.create(model=model_name, messages=chat("Count to ten."), n=2, max_tokens=400,
                                              temperature=0, extra_body=IGNORE_EOS, stream=True) for _ in range(2)]
    firsts = [next(iter(stream)) for stream in streams]  # the four choices now hold the four queue places
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(model=model_name, messages=chat("hi"), max_tokens=2)
    assert full.value.status_code == 429 and full.value.code == "queue_full"
    for first, stream in zip(firsts, streams):
        rest = list(stream)
        assert sum(c.choices[0].finish_reason == "length" for c in [first, *rest] if c.choices) == 2
    wait_until(lambda: client.chat.completions.create(model=model_name, messages=chat("hi"), max_tokens=2)
               .choices[0].finish_reason is not None)


# the rest of the surface ------------------------------------------------------


def test_metrics_and_kv_map(client: openai.OpenAI, url: str, model_name: str) -> None:
    before = metric(url, "edgeserve_completion_tokens_total")
    requests_ok = metric(url, 'edgeserve_http_requests_total{code="200"}')
    client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0, extra_body=IGNORE_EOS)
    assert metric(url, "edgeserve_completion_tokens_total") == before + 3
    assert metric(url, 'edgeserve_http_requests_total{code="200"}') == requests_ok + 1
    text = http.get(url + "/metrics").text
    for name in ("edgeserve_time_to_first_token_seconds_bucket", "edgeserve_time_per_output_token_seconds_count",
                 "edgeserve_prefix_cache_hit_tokens_total", "edgeserve_preemptions_total",
                 "edgeserve_requests_waiting", "edgeserve_prompt_tokens_total"):
        assert name in text
    assert metric(url, 'edgeserve_time_to_first_token_seconds_bucket{le="+Inf"}') == \
        metric(url, "edgeserve_time_to_first_token_seconds_count") > 0
    kv = http.get(url + "/v1/edgeserve/kv").json()
    assert kv["block_size"] == 16 and len(kv["blocks"]) == kv["num_blocks"] == metric(url, "edgeserve_kv_blocks_total")
    assert {b["state"] for b in kv["blocks"]} <= {"free", "cached", "used", "shared"}
    assert sum(kv["counts"].values()) == kv["num_blocks"]


def test_http_bench_counts_every_token(url: str, engine: AsyncEngine, model_name: str) -> None:
    work = [BenchRequest(engine.tokenizer.encode(text), text, 5) for text in ("one", "two", "three", "four")]
    result = asyncio.run(run_http_bench(url, work, concurrency=2, model=model_name, progress=False))
    summary = result.summary()
    assert summary["requests"] == 4 and summary["output_tokens"] == 20
    assert all(0 < t.ttft <= t.latency for t in result.timings)


def test_serve_refuses_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = CliRunner().invoke(cli, ["serve", "--port", str(taken.getsockname()[1])])
    assert result.exit_code == 1 and "cannot listen on 127.0.0.1" in result.output
