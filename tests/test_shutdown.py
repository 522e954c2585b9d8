"""SIGTERM and Ctrl-C drain `edgeserve serve`: new requests get 503, running ones finish within the grace
period or end with finish_reason "abort" (streams with [DONE]), and the process exits 0.

A real server process on the default model, real signals, real HTTP over loopback.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from serve_process import STORY, ServeProcess, Stream

GRACE = 8.0  # --shutdown-timeout: long enough for a short answer on a busy CPU
LONG = 1000  # tokens no stream can produce within GRACE on a CPU
SHORT = 24
BODY = {"messages": STORY, "ignore_eos": True}


def serve(model_path, grace: float) -> Iterator[ServeProcess]:
    server = ServeProcess(str(model_path), "--kv-memory", "256MiB", "--shutdown-timeout", str(grace))
    yield server
    server.close()


@pytest.fixture
def server(model_path) -> Iterator[ServeProcess]:
    yield from serve(model_path, GRACE)


@pytest.fixture
def patient_server(model_path) -> Iterator[ServeProcess]:
    yield from serve(model_path, 300)


def running(url: str) -> int:
    health = httpx.get(url + "/health", timeout=10).json()
    return health.get("running", 0) + health.get("waiting", 0)


def test_sigterm_lets_running_requests_finish_then_aborts_the_rest(server):
    url = server.url
    long_streams = [Stream(url, LONG) for _ in range(3)]
    answer: dict[str, httpx.Response] = {}
    plain = threading.Thread(target=lambda: answer.update(r=httpx.post(
        url + "/v1/chat/completions", json={**BODY, "max_tokens": LONG}, timeout=120)), daemon=True)
    plain.start()
    deadline = time.monotonic() + 60
    while running(url) < 4:
        assert time.monotonic() < deadline, "the non-streaming request never started"
        time.sleep(0.05)
    short = Stream(url, SHORT)

    sigterm = time.monotonic()
    server.signal(signal.SIGTERM)

    # Draining: new requests are refused with an OpenAI-style 503, and /health says so.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 5
    while True:  # the signal reaches the server at its own pace
        try:
            client.chat.completions.create(model="x", messages=BODY["messages"], max_tokens=2)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            assert exc.body["code"] == "server_shutting_down" and exc.body["type"] == "server_error"
            break
        assert time.monotonic() < deadline, "still admitting requests after SIGTERM"
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"

    # The short answer finishes within the grace period; the long ones are aborted at its end.
    short.join()
    assert short.error is None and short.finish_reason == "length" and short.done
    for stream in long_streams:
        stream.join()
        assert stream.error is None and stream.finish_reason == "abort" and stream.done and stream.text
        assert stream.finished_at - sigterm > GRACE - 1
    plain.join(60)
    resp = answer["r"]
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["message"]["content"]
    assert 0 < body["usage"]["completion_tokens"] < LONG

    assert server.wait(30) == 0
    log = server.output()
    assert "graceful shutdown exceeded" not in log and "Traceback" not in log


def test_a_second_ctrl_c_aborts_at_once(patient_server):
    stream = Stream(patient_server.url, LONG)
    patient_server.signal(signal.SIGINT)
    time.sleep(1)
    assert stream.finished_at is None  # the first one only drains, for up to 300 s
    second = time.monotonic()
    patient_server.signal(signal.SIGINT)
    stream.join()
    assert stream.error is None and stream.finish_reason == "abort" and stream.done
    assert stream.finished_at - second < 5
    assert patient_server.wait(30) == 0
    assert "Traceback" not in patient_server.output()


def test_the_drain_waits_for_requests_before_the_engine_and_they_end_in_503(tiny_model, monkeypatch) -> None:
    """A request still rendering its prompt when the signal comes holds the exit back, then gets a clean 503."""
    import asyncio

    import uvicorn

    from edgeserve.config import EngineConfig
    from edgeserve.engine.async_engine import AsyncEngine
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.server.app import create_app
    from edgeserve.server.shutdown import DrainingServer
    from loopback import ServerThread

    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    rendering, release = threading.Event(), threading.Event()
    chat_prompt = AsyncEngine.chat_prompt

    async def slow_chat_prompt(self, *args, **kwargs):
        rendering.set()
        await asyncio.to_thread(release.wait, 30)
        return await chat_prompt(self, *args, **kwargs)

    monkeypatch.setattr(AsyncEngine, "chat_prompt", slow_chat_prompt)
    app = create_app(aengine, "tiny")
    served = ServerThread(app)
    answers: list[httpx.Response] = []
    try:
        asker = threading.Thread(target=lambda: answers.append(httpx.post(
            served.url + "/v1/chat/completions", json={"messages": STORY, "max_tokens": 2}, timeout=60)))
        asker.start()
        assert rendering.wait(30)
        drain = DrainingServer(uvicorn.Config(app), app.state.server, shutdown_timeout=30)
        drain.handle_exit(signal.SIGTERM, None)
        assert not drain._drained(time.monotonic())  # nothing in the engine, but a request on its way there
        release.set()
        asker.join(30)
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "server_shutting_down"
        deadline = time.monotonic() + 10
        while not drain._drained(time.monotonic()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        served.stop()
        aengine.shutdown()
