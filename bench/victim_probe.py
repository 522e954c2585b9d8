"""One hostile but ordinary client at a time against `edgeserve serve`, and what it does to everyone else.

A victim streams a greedy answer the whole time; each probe runs beside it, and the victim's worst gap between
tokens during the probe is compared with its normal gap (the median before any probe). The probes:

  stop strings    n=16 with 300,000 short stop strings (refused: the body is over 2 MiB; at most 16 anyway)
  logprobs        a non-streamed n=16, 64-token answer with 20 logprobs a token (its body built and encoded
                  off the loop)
  big grammars    eight concurrent 15,000-property JSON Schemas (refused: grammar texts are bounded; each
                  schema made text once)
  idle sockets    1,100 connections that never send a byte (closed after the idle time; a limit under the
                  open-file limit)
  queue hog       4 prompts x n=64 (refused: one request may run half the queue at most)
  empty messages  120,000 empty messages (refused: the body is over 2 MiB)
  kept-alive      non-streamed requests on one kept-alive connection (TCP_NODELAY: no ~40 ms delayed-ACK wait)

    python bench/victim_probe.py [--json]
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import click
import httpx
from tqdm import tqdm

from soak import Server

VICTIM = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "max_tokens": 100000,
          "temperature": 0, "stream": True, "ignore_eos": True}


class Victim:
    """A greedy stream in a process of its own, restarted whenever it ends; the arrival time of every chunk.

    Its own process: in the probes' process, their client's work (Python, holding that process's GIL) delayed the
    victim's reads, and the probe measured itself.
    """

    def __init__(self, url: str):
        self.times: list[float] = []
        self._arrivals, sender = multiprocessing.Pipe(duplex=False)
        self._process = multiprocessing.get_context("spawn").Process(target=_stream, args=(url, sender), daemon=True)
        self._process.start()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        try:
            while True:
                self.times.append(self._arrivals.recv())
        except EOFError:
            pass

    def stop(self) -> None:
        self._process.terminate()
        self._process.join()

    def worst_gap(self, since: float, until: float) -> float:
        inside = [t for t in self.times if since <= t <= until]
        before = [t for t in self.times if t < since][-1:]
        stamps = before + inside + ([until] if inside or before else [])
        return max((b - a for a, b in zip(stamps, stamps[1:])), default=until - since)

    def normal_gap(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:]))


# One client for every probe, made before any: making an httpx client takes ~60 ms of CPU (its TLS context), which
# on a small machine the victim's engine would pay for, and which no server can save anyone from.
CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=16))


def _stream(url: str, arrivals: Connection) -> None:
    """The victim: stream greedy answers for ever, sending the (system-wide monotonic) time each chunk arrives."""
    with httpx.Client(timeout=600) as http:
        while True:
            with http.stream("POST", url + "/v1/chat/completions", json=VICTIM) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.send(time.monotonic())


def _post(url: str, path: str, body: dict | bytes) -> str:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = CLIENT.post(url + path, content=content, headers={"content-type": "application/json"})
    if answer.status_code == 200:
        return "200"
    error = answer.json().get("error", {})
    return f"{answer.status_code} {error.get('code') or ''}".strip()


# Bodies encoded before the probes, so that the client's own work stays out of the victim's timing.
STOP_STRINGS = json.dumps({"prompt": "Hi", "n": 16, "max_tokens": 8, "stop": [f"s{i}" for i in range(300_000)]})
BIG_SCHEMA = json.dumps({"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 4, "response_format": {
    "type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(15_000)}}}}})
EMPTY_MESSAGES = json.dumps({"messages": [{"role": "user", "content": ""}] * 120_000, "max_tokens": 2})


def stop_strings(url: str) -> str:
    return _post(url, "/v1/completions", STOP_STRINGS.encode())


def logprobs(url: str) -> str:
    return _post(url, "/v1/completions", {"prompt": "Once upon a time", "n": 16, "max_tokens": 64, "logprobs": 20,
                                          "ignore_eos": True})


def big_grammars(url: str) -> str:
    body = BIG_SCHEMA.encode()
    outcomes: list[str] = []
    threads = [threading.Thread(target=lambda: outcomes.append(_post(url, "/v1/chat/completions", body)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ", ".join(sorted(set(outcomes)))


def idle_sockets(url: str) -> str:
    host, port = url.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(1100):
            held.append(socket.create_connection((host, int(port)), timeout=5))
    except OSError as exc:
        return f"opened {len(held)}: {exc}"
    try:
        time.sleep(1)
        fresh = CLIENT.get(url + "/health", timeout=30).status_code
        closed = 0
        deadline = time.monotonic() + 15
        for s in held:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                closed += s.recv(1) == b""
            except OSError:
                pass
        return f"a new client got {fresh}; {closed}/{len(held)} silent sockets closed by the server"
    finally:
        for s in held:
            s.close()


def queue_hog(url: str) -> str:
    return _post(url, "/v1/completions", {"prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 4})


def empty_messages(url: str) -> str:
    return _post(url, "/v1/chat/completions", EMPTY_MESSAGES.encode())


def kept_alive(url: str) -> str:
    CLIENT.get(url + "/health")
    times = []
    for _ in range(20):
        started = time.perf_counter()
        CLIENT.post(url + "/tokenize", json={"content": "hello"})
        times.append(time.perf_counter() - started)
    return f"median {statistics.median(times) * 1000:.1f} ms a request"


PROBES: dict[str, Callable[[str], str]] = {
    "stop strings": stop_strings, "logprobs": logprobs, "big grammars": big_grammars, "idle sockets": idle_sockets,
    "queue hog": queue_hog, "empty messages": empty_messages, "kept-alive": kept_alive,
}


@click.command()
@click.option("--model", default="smollm2-135m-instruct", show_default=True)
@click.option("--probe", "only", multiple=True, type=click.Choice(list(PROBES)), help="Run only these probes.")
@click.option("--json", "as_json", is_flag=True, help="Also print the figures as JSON on the last line.")
def main(model: str, only: tuple[str, ...], as_json: bool) -> None:
    """Run the probes one by one beside a victim stream and print what each did to it."""
    server = Server(model, "1GiB", None)
    victim = Victim(server.url)
    try:
        while len(victim.times) < 40:
            time.sleep(0.1)
        normal = victim.normal_gap()
        rows = []
        for name, probe in tqdm([(n, p) for n, p in PROBES.items() if n in only or not only], desc="probes",
                                unit="probe"):
            started = time.monotonic()
            outcome = probe(server.url)
            ended = time.monotonic()
            time.sleep(0.5)  # the victim's next token shows whether the probe left it stalled
            worst = victim.worst_gap(started, max(ended, time.monotonic()))
            rows.append({"probe": name, "outcome": outcome, "seconds": round(ended - started, 2),
                         "worst_gap_ms": round(worst * 1000, 1), "ratio": round(worst / normal, 1)})
    finally:
        victim.stop()
        server.stop()
    click.echo(f"victim's normal gap between tokens: {normal * 1000:.1f} ms")
    width = max(len(r["outcome"]) for r in rows)
    click.echo(f"{'probe':<15} {'outcome':<{width}} {'took':>7} {'worst gap':>10} {'x normal':>9}")
    for r in rows:
        click.echo(f"{r['probe']:<15} {r['outcome']:<{width}} {r['seconds']:>6}s {r['worst_gap_ms']:>8}ms "
                   f"{r['ratio']:>8}x")
    if as_json:
        click.echo(json.dumps({"normal_gap_ms": round(normal * 1000, 1), "probes": rows}))


if __name__ == "__main__":
    main()
