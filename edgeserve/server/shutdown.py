"""Shutting the server down without cutting anyone off: on SIGTERM or SIGINT it drains.

New requests get 503 (and /health says "draining") while running ones go on for a grace period;
what is still running then ends with finish_reason "abort": streams get their final chunk and
[DONE], other requests their JSON body. Then uvicorn closes the connections and the process exits 0.
"""

from __future__ import annotations

import logging
import math
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from edgeserve.server import DEFAULT_SHUTDOWN_TIMEOUT

if TYPE_CHECKING:
    from edgeserve.server.app import Server

# How long aborted requests get to send their last bytes before the process stops waiting for them.
FLUSH_TIMEOUT = 5.0

logger = logging.getLogger("edgeserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn serving the app, draining on the first signal; a second aborts at once, a third exits now."""

    def __init__(self, config: uvicorn.Config, server: Server, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        super().__init__(config)
        self.api = server
        self.shutdown_timeout = shutdown_timeout
        self.deadline = math.inf  # when running requests get aborted
        self.aborted = False
        self.signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's own: that one raises the signal again once shut down, so a drained server
        # would still end with SIGTERM's status instead of 0.
        self.signals += 1
        now = time.monotonic()
        if self.signals == 1:
            self.api.draining = True
            self.deadline = now + self.shutdown_timeout
            logger.info("shutting down: %d requests running, %.0fs to finish (a second signal aborts them)",
                        len(self.api.live), self.shutdown_timeout)
        elif self.signals == 2:
            self.deadline = now
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s on the event loop, so the drain needs no task or lock of its own.
        if self.api.draining and not self.should_exit:
            self.should_exit = self._drained(time.monotonic())
        return await super().on_tick(counter)

    def _drained(self, now: float) -> bool:
        """Whether no request is left, in the engine or before it (rendering, tokenizing, compiling a grammar: those
        end with a 503 once they reach admission); aborts those in the engine at the deadline."""
        if not self.api.live and not self.api.open_requests:
            return True
        if not self.aborted and now >= self.deadline:
            logger.info("shutting down: aborting %d requests still running", len(self.api.live))
            self.api.abort_all()
            self.aborted = True
        return self.aborted and now >= self.deadline + FLUSH_TIMEOUT
