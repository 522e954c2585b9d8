"""A uvicorn server on a free loopback port, in a background thread, for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.server.app import create_app


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread."""

    def __init__(self, app: FastAPI):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serving(model: Any, name: str, kv_memory: str = "128MiB", **app_options: Any) -> Iterator[ServerThread]:
    """A server of `model` (a loaded model) as `name`, on an engine of its own, for as long as the block runs."""
    aengine = AsyncEngine(LLMEngine(model, EngineConfig(backend="numpy", kv_memory=kv_memory)))
    server = ServerThread(create_app(aengine, name, **app_options))
    try:
        yield server
    finally:
        server.stop()
        aengine.shutdown()
