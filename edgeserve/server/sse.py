"""Server-sent events, as every API family streams them: one event, and a stream that reports a failure midway."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

logger = logging.getLogger("edgeserve.server")


def sse(payload: dict | str, event: str | None = None) -> str:
    """One server-sent event (named, for the APIs that name theirs)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def sse_response(events: AsyncIterator[str], failure: Callable[[Exception], str],
                 last: str | None = None) -> StreamingResponse:
    """The events, then `last`; if generation fails midway, failure(exc)'s event before it."""

    async def stream() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the status line has gone out already: tell the client in the stream
            logger.error("stream failed: %s", exc)
            yield failure(exc)
        if last is not None:
            yield last

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
