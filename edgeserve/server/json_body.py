"""JSON bodies off the event loop: a large request body parsed on a thread of its own, and non-streamed answers
built and encoded on a worker thread, so that a large body (a schema of thousands of properties, n answers with
logprobs) does not stall everyone else's streams while it is read or made."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic_core
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from edgeserve.engine.async_engine import AsyncEngine

# A body this small parses in well under a millisecond: in place, cheaper than handing it to the parsing thread.
PARSE_IN_PLACE_BYTES = 64 * 1024
# A body with this many containers takes a millisecond or more to parse (counted as its opening brackets, strings
# included: a guess that errs towards the gate).
BULK_CONTAINERS = 2000
_parser = ThreadPoolExecutor(1, thread_name_prefix="edgeserve-json")


def _parse_between_steps(body: bytes) -> Any:
    """body's JSON; between two of the engines' steps where it holds thousands of objects and arrays (a parse of
    milliseconds holding the GIL: strings, however long, parse fast)."""
    if body.count(b"{") + body.count(b"[") < BULK_CONTAINERS:
        return _parse(body)
    with AsyncEngine.between_steps():
        return _parse(body)


def _parse(body: bytes) -> Any:
    """body's JSON, by pydantic-core's parser (twice json's speed, so half its time holding the GIL); where that
    refuses the text (bad JSON, or a lone surrogate, which json takes), by json: its values, and its error, which
    the answer shows."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)


class JsonBodyRequest(Request):
    """A request whose large JSON body is parsed on the parsing thread.

    Parsing holds the GIL, so the thread makes no parse cheaper. But on the event loop, the bodies of requests that
    arrive together are parsed back to back in one turn of the loop, and every stream's next token waits for all
    of them (eight bodies of a 15,000-property schema, ~80 ms); on one thread, one at a time, and a body of
    thousands of objects between two of the engine's steps (engine/step_gate.py), the loop and the engine wait
    for one parse at most.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            body = await self.body()
            if len(body) < PARSE_IN_PLACE_BYTES:
                self._parsed = json.loads(body)
            else:
                self._parsed = await asyncio.get_running_loop().run_in_executor(_parser, _parse_between_steps, body)
        return self._parsed


class JsonBodyRoute(APIRoute):
    """A route whose handler reads its request as a JsonBodyRequest."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def parsed_off_the_loop(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return parsed_off_the_loop


def _encode(build: Callable[[], dict]) -> bytes:
    """build()'s body as JSON, each element of a top-level list (the answers) by a call of its own: an encoder
    holds the GIL for a whole call, and 16 answers with 20 logprobs a token are a megabyte, which held every stream
    for tens of milliseconds. pydantic-core's encoder writes the same text as json's, in a quarter of its time; a
    NaN or infinity, which no JSON may hold, becomes null."""
    def part(value: Any) -> bytes:
        return pydantic_core.to_json(value, inf_nan_mode="null")

    def field(value: Any) -> bytes:
        return b"[" + b",".join(map(part, value)) + b"]" if isinstance(value, list) else part(value)

    return b"{" + b",".join(part(key) + b":" + field(value) for key, value in build().items()) + b"}"


async def json_answer(build: Callable[[], dict]) -> Response:
    """build()'s body as a JSON response, built and encoded on a worker thread: returned as a dict, FastAPI would
    run it through its jsonable_encoder on the event loop, ~10x json.dumps' time."""
    return Response(await asyncio.to_thread(_encode, build), media_type="application/json")
