"""`edgeserve serve` as a child process on a loopback port, for tests that signal, kill or restart it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """`edgeserve serve -m MODEL ARGS` on `port` (a free one by default), answering /health when built."""

    def __init__(self, model: str, *args: str, port: int | None = None, env: dict[str, str] | None = None,
                 start_timeout: float = 180):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A file, not a pipe: a server logging into a pipe nobody reads would block once it fills.
        self._log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgeserve.cli", "serve", "-m", model, "--backend", "numpy",
             "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise AssertionError(f"the server did not start:\n{self.output()}") from None
                time.sleep(0.1)

    def output(self) -> str:
        """Everything the server has printed so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status, waiting at most `timeout` seconds (killing it then, and failing)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit in {timeout}s:\n{self.output()}") from None

    def close(self) -> None:
        """Kill it if it still runs; for fixtures' teardown."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
