"""Connections no client can hoard: one that sends nothing is closed after the keep-alive time, as an idle kept-alive
one is, and past a limit below the process's open-file limit new ones get 503 instead of the accept loop failing
with "Too many open files" for everyone."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import resource
except ImportError:  # not on Windows: the limits stay as the system sets them
    resource = None

IDLE_TIMEOUT = 5.0  # seconds a connection may stay silent, before its first request as between requests
# asyncio accepts up to `backlog` waiting connections in one turn of the event loop (~110 us each), and it is the
# listen queue's length too: with uvicorn's 2048, a burst of 1,100 connects held every stream's next token ~130 ms;
# with 128, turns of ~15 ms back to back (11x its gap); with 64, 7x. A burst beyond the queue retries a second later.
ACCEPT_BACKLOG = 64
SPARE_FILES = 64  # open files kept for the model, logs and the engine's own use
MAX_OPEN_FILES = 65536


class IdleClosingH11(H11Protocol):
    """uvicorn's h11 protocol, with no way to hold a connection by saying nothing or half a request: its keep-alive
    timer also runs from the moment a connection opens (uvicorn starts it only after a first response), a request's
    head must arrive whole within the idle time of its first byte, and its body may not pause longer than that
    (uvicorn stops the timer at any byte, so a half-sent request held its connection for ever)."""

    _head_started: float | None = None  # loop time of the first byte of a request head not yet whole

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        running = self.cycle is not None and not self.cycle.response_complete
        if running and not self.cycle.more_body:  # the whole request is in: the app has it
            self._head_started = None
            return
        now = self.loop.time()
        if running:  # its body is still coming
            self._head_started = None
            delay = self.timeout_keep_alive
        else:
            if self._head_started is None:
                self._head_started = now
            delay = self._head_started + self.timeout_keep_alive - now
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(delay, self._close_unfinished)

    def _close_unfinished(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()  # connection_lost tells a running request's app that its client went


def connection_limit() -> int | None:
    """Raise the open-file limit to what the system allows (capped), and return how many connections to serve at
    once: the limit less some spare files; None where the platform has no such limits."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # macOS refuses some values above its kernel maximum: keep what we have
            pass
    return max(16, soft - SPARE_FILES)
