"""Callers that give up mid-flight: a cancelled `AsyncEngine.call()` or stream never makes the engine thread
set a result on a dead future (the InvalidStateError once printed when the TUI quit while an answer streamed),
in-process and behind the server."""

from __future__ import annotations

import asyncio
import logging
import os
import random

import httpx
import pytest

from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.app import create_app
from loopback import ServerThread

# a second in the quick loop; CI races more
ROUNDS = 200 if "CI" in os.environ else 50
PROMPT = [10 + i % 60 for i in range(24)]


@pytest.fixture
def aengine(tiny_model):
    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    yield aengine
    aengine.shutdown()


def loop_errors() -> list[dict]:
    """Route the running loop's unhandled callback errors into a list."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    return errors


async def test_a_call_cancelled_after_the_engine_answered_it_is_left_alone(aengine):
    errors = loop_errors()
    loop = asyncio.get_running_loop()
    for _ in range(ROUNDS):
        caller: asyncio.Task | None = None

        def answer_after_the_caller_left(engine: LLMEngine) -> int:
            # the cancellation reaches the loop before the answer does: the window the bug lived in
            loop.call_soon_threadsafe(caller.cancel)
            return len(engine.request_ids())

        caller = asyncio.ensure_future(aengine.call(answer_after_the_caller_left))
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)  # let the answer's callback run
    failing: list[int] = []

    def fail(engine: LLMEngine) -> None:
        failing.append(1)
        loop.call_soon_threadsafe(caller.cancel)
        raise RuntimeError("this call fails after its caller left")

    caller = asyncio.ensure_future(aengine.call(fail))
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0.05)

    assert failing == [1]
    assert errors == []
    assert await aengine.call(lambda engine: "still answering") == "still answering"


async def test_callers_cancelled_at_random_moments_while_answers_stream(aengine):
    errors = loop_errors()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def stream() -> int:
        """The tokens streamed (an output carries several where a step checked guesses)."""
        return sum([len(out.token_ids) async for out in aengine.generate(PROMPT, params)])

    for _ in range(ROUNDS // 4):
        tasks = [asyncio.ensure_future(aengine.kv_map()) for _ in range(4)]
        tasks += [asyncio.ensure_future(stream()) for _ in range(2)]
        await asyncio.sleep(rng.uniform(0, 0.01))
        for task in rng.sample(tasks, 4):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    await asyncio.sleep(0.05)
    assert errors == []
    assert await aengine.call(lambda engine: engine.request_ids()) == []  # every cancelled stream was aborted
    assert await stream() == params.max_tokens


def test_the_server_survives_clients_leaving_mid_flight(aengine, caplog):
    server = ServerThread(create_app(aengine, "tiny"))
    rng = random.Random(1)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 16, "stream": True, "ignore_eos": True}
    try:
        with caplog.at_level(logging.ERROR):
            for _ in range(ROUNDS // 10):
                with httpx.Client(base_url=server.url, timeout=rng.uniform(0.001, 0.02)) as client:
                    for path in ("/v1/edgeserve/kv", "/v1/completions"):
                        try:
                            if path.endswith("kv"):
                                client.get(path)
                            else:
                                with client.stream("POST", path, json=body) as response:
                                    next(response.iter_lines())
                        except httpx.HTTPError:
                            pass  # the client gave up: what this test is after
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/v1/edgeserve/kv").status_code == 200
            answer = client.post("/v1/completions", json={**body, "stream": False})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 16
    finally:
        server.stop()
    assert not [r for r in caplog.records if "InvalidStateError" in r.getMessage() + str(r.exc_info)]


def test_the_request_log_line_says_what_the_prefix_cache_held(aengine, caplog):
    """Two prompts that part at a known token: the second's log line gives its cached tokens and that offset."""
    server = ServerThread(create_app(aengine, "tiny"))
    shared = list(range(10, 74))  # four 16-token blocks
    try:
        with caplog.at_level(logging.INFO, logger="edgeserve"), httpx.Client(base_url=server.url) as client:
            for tail in ([1] * 40, [2] * 40):
                prompt = shared + [5, 6, 7] + tail  # the second prompt leaves the cached one at token 67
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if " prompt=107 " in r.getMessage()]
    assert len(lines) == 2 and "cached=0 diverged=0 " in lines[0], lines
    assert "cached=64 diverged=67 " in lines[1], lines
