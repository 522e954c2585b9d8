"""`edgeserve serve` as a child process on a loopback port, for tests that signal, kill or restart it, and
streaming requests to it read on threads of their own."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive loopback ports free now, below the ephemeral range (Linux: 32768 and up):
    ports just above one the system handed out are its next ephemeral ones, which the connections of tests
    running beside this one take (an MLX ring on free_port() + 1 failed to bind under pytest-xdist)."""
    rng = random.Random()
    while True:
        first = rng.randrange(20000, 32768 - n)
        socks = []
        try:
            for port in range(first, first + n):
                socks.append(sock := socket.socket())
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


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

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (all its threads): work done, whatever else the machine runs."""
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

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


class Stream:
    """A streaming chat request read on its own thread: its chunks, whether [DONE] came, when it finished."""

    def __init__(self, url: str, max_tokens: int):
        self.chunks: list[dict] = []
        self.done = False
        self.finished_at: float | None = None
        self.error: Exception | None = None  # the connection's, if it broke
        self.errors: list[dict] = []  # error events in the stream
        self.started = threading.Event()  # the first content has arrived
        self._thread = threading.Thread(target=self._read, args=(url, max_tokens), daemon=True)
        self._thread.start()
        assert self.started.wait(120), self.error

    def _read(self, url: str, max_tokens: int) -> None:
        body = {"messages": STORY, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    choice = event["choices"][0]
                    self.chunks.append(choice)
                    if choice["delta"].get("content"):
                        self.started.set()
                    if choice["finish_reason"]:
                        self.finished_at = time.monotonic()
        except Exception as exc:
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> None:
        """Wait for the end of the stream (or of its connection)."""
        self._thread.join(60)
        assert not self._thread.is_alive()

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["finish_reason"] if self.chunks else None

    @property
    def text(self) -> str:
        return "".join(c["delta"].get("content", "") for c in self.chunks)
