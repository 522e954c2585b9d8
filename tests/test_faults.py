"""Faults around a running `edgeserve serve`: kill -9 and restart, a client that never reads its stream, and
an engine thread that raises. Real server processes of the tiny model, real HTTP over loopback.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from edgeserve.engine.async_engine import FAULT_ENV
from model_folder import write_model_folder
from serve_process import STORY, ServeProcess, Stream

POOL = ("--kv-memory", "16MiB")


@pytest.fixture(scope="module")
def tiny_folder(tiny_model, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("served") / "tiny"
    write_model_folder(tiny_model, folder)
    return str(folder)


def kv_used(url: str) -> int:
    """KV blocks held by requests (not free, not merely cached)."""
    counts = httpx.get(url + "/v1/edgeserve/kv", timeout=10).json()["counts"]
    return counts["used"] + counts["shared"]


def in_flight(url: str) -> int:
    health = httpx.get(url + "/health", timeout=10).json()
    return health["running"] + health["waiting"]


def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def answers(url: str) -> str:
    """A normal chat answer through the official client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=STORY, max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    return reply.choices[0].message.content


@pytest.mark.slow  # two server processes and a load: about eight seconds of CPU
def test_kill_9_under_load_then_restart(tiny_folder):
    first = ServeProcess(tiny_folder, *POOL)
    try:
        streams = [Stream(first.url, 3000) for _ in range(4)]
        first.proc.kill()
        assert first.wait(10) == -signal.SIGKILL
        for stream in streams:
            stream.join()
            assert stream.error is not None or not stream.done  # cut off, not finished
    finally:
        first.close()

    again = ServeProcess(tiny_folder, *POOL, port=first.port)
    try:
        assert httpx.get(again.url + "/health", timeout=10).json()["status"] == "ok"
        assert answers(again.url)
        assert kv_used(again.url) == 0
    finally:
        again.close()


@pytest.mark.slow  # a server process
def test_a_client_that_never_reads_its_stream_costs_only_itself(tiny_folder):
    server = ServeProcess(tiny_folder, *POOL)
    try:
        body = json.dumps({"messages": STORY, "max_tokens": 3500, "ignore_eos": True, "stream": True}).encode()
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server soon blocks
        stuck.connect(("127.0.0.1", server.port))
        stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: kv_used(server.url) > 0, 30, "the unread stream never started")

        with ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            replies = list(pool.map(lambda _: answers(server.url), range(8)))
        assert all(replies) and time.monotonic() - started < 60

        stuck.close()  # unread data makes this a reset: the server sees the client go away
        until(lambda: in_flight(server.url) == 0 and kv_used(server.url) == 0, 30,
              "the unread stream's request or blocks outlived its client")
        assert answers(server.url)
    finally:
        server.close()


@pytest.mark.slow  # a server process
def test_an_engine_thread_that_raises_shows_in_health(tiny_folder):
    server = ServeProcess(tiny_folder, *POOL, env={FAULT_ENV: "5"})
    try:
        stream = Stream(server.url, 50)
        stream.join()
        assert stream.error is None and stream.done
        assert stream.errors and "injected engine fault" in stream.errors[0]["message"]

        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "injected engine fault" in health.json()["error"]
        started = time.monotonic()
        resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": STORY, "max_tokens": 4},
                          timeout=60)
        assert resp.status_code >= 500 and "engine" in resp.json()["error"]["message"]
        assert time.monotonic() - started < 5  # at once, not after the client gives up

        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        server.close()
