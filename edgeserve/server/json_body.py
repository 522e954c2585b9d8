"""Non-streamed answers, built and encoded off the event loop: a large body (n answers with logprobs) must not
stall everyone else's streams while it is made."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi.responses import Response


def _encode(build: Callable[[], dict]) -> bytes:
    return json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def json_answer(build: Callable[[], dict]) -> Response:
    """build()'s body as a JSON response, built and encoded on a worker thread: returned as a dict, FastAPI would
    run it through its jsonable_encoder on the event loop, ~10x json.dumps' time."""
    return Response(await asyncio.to_thread(_encode, build), media_type="application/json")
