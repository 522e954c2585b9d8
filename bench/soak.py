"""Soak `edgeserve serve`: many clients for minutes, good and bad, against a small KV pool.

Starts a real server process (the default model, a KV pool small enough to force preemption) and
runs CLIENTS concurrent clients for MINUTES, each picking at random:

- normal: a chat request (streaming or not, greedy or sampled); it must end with 200, a finish
  reason of stop or length, and [DONE] for a stream. Any other end is a good request lost.
  Greedy answers to the same request must match the first one seen (batch invariance);
- disconnect: a stream closed after a few chunks, or a plain request given up after a moment;
- prefill abort: a long prompt whose client hangs up before its first token;
- bad body: invalid JSON, wrong types and values; each must be a 4xx with an OpenAI-style error;
- oversized: prompts beyond the context; each must be a 400 context_length_exceeded.

Then it waits for the server to go idle and reports requests by kind and outcome, p50/p99 latency
of the normal ones, KV blocks still held (leaked: must be 0), the server's RSS over the run (must
level off, once the prefix store's RAM tier, reported beside it, has filled: a minute may not see
that), preemptions, and how SIGTERM drained it (exit status 0).

    python bench/soak.py                      # 16 clients, 10 minutes
    python bench/soak.py --minutes 1 --json   # also the figures as JSON on the last line
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import click
import httpx
import numpy as np
import psutil
from tqdm import tqdm

from edgeserve.models.catalog import DEFAULT_MODEL

TOPICS = ["the sea", "a lighthouse keeper", "bread baking", "the moon", "a lost key", "winter birds",
          "an old clock", "mountain trains"]
NORMAL, DISCONNECT, PREFILL_ABORT, BAD_BODY, OVERSIZED = "normal", "disconnect", "prefill abort", "bad body", "oversized"
MIX = {NORMAL: 0.5, DISCONNECT: 0.15, PREFILL_ABORT: 0.1, BAD_BODY: 0.15, OVERSIZED: 0.1}
HI = [{"role": "user", "content": "hi"}]
# Each must be refused with a 4xx and an OpenAI-style error body: (path, body; bytes are sent as they are).
BAD_BODIES: list[tuple[str, object]] = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b""),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": -5}),
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": HI, "n": 0}),
    ("/v1/chat/completions", {"messages": HI, "top_p": 7}),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"²": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/chat/completions", {"messages": HI, "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": HI, "stop": [["nested"]]}),
    ("/v1/completions", {"prompt": [[-1, 5]]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1e300}),
    ("/v1/completions", {"prompt": {"text": "hi"}}),
]


@dataclass
class Tally:
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    latencies: list[float] = field(default_factory=list)  # seconds, normal requests served
    ttfts: list[float] = field(default_factory=list)  # seconds, normal streams served
    greedy: dict[str, str] = field(default_factory=dict)  # request -> the first answer seen
    greedy_mismatches: int = 0

    def served(self, kind: str) -> int:
        return self.outcomes[(kind, "ok")]

    def lost(self) -> int:
        return sum(n for (kind, outcome), n in self.outcomes.items() if kind == NORMAL and outcome != "ok")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _story(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write a few sentences about {topic}."}]


async def _normal(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> str:
    topic = rng.choice(TOPICS)
    max_tokens = rng.choice([8, 16, 32, 64])
    greedy = rng.random() < 0.5
    stream = rng.random() < 0.5
    body = {"messages": _story(topic), "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
    if not greedy:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    started = time.monotonic()
    ttft = None
    if stream:
        text, finish, done = [], None, False
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"http {resp.status_code}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return "error event"
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    ttft = ttft or time.monotonic() - started
                    text.append(choice["delta"]["content"])
                finish = choice["finish_reason"] or finish
        if not done:
            return "no [DONE]"
        answer = "".join(text)
    else:
        resp = await client.post("/v1/chat/completions", json=body)
        if resp.status_code != 200:
            return f"http {resp.status_code}"
        choice = resp.json()["choices"][0]
        answer, finish = choice["message"]["content"], choice["finish_reason"]
    if finish not in ("stop", "length"):
        return f"finish {finish}"
    tally.latencies.append(time.monotonic() - started)
    if ttft is not None:
        tally.ttfts.append(ttft)
    if greedy:
        first = tally.greedy.setdefault(f"{topic}/{max_tokens}", answer)
        tally.greedy_mismatches += first != answer
    return "ok"


async def _disconnect(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {"messages": _story(rng.choice(TOPICS)), "max_tokens": 64, "ignore_eos": True}
    if rng.random() < 0.5:
        chunks = rng.randint(1, 10)
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                chunks -= line.startswith("data: ")
                if chunks <= 0:
                    break  # leaving the block unread closes the connection
        return "ok"
    try:
        await asyncio.wait_for(client.post("/v1/chat/completions", json=body), rng.uniform(0.05, 2.0))
    except asyncio.TimeoutError:
        pass
    return "ok"


async def _prefill_abort(client: httpx.AsyncClient, rng: random.Random, long_prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 16, "stream": rng.random() < 0.5}
    try:
        await asyncio.wait_for(client.post("/v1/chat/completions", json=body), rng.uniform(0.005, 0.2))
    except asyncio.TimeoutError:
        return "ok"
    return "answered first"  # not an error: the prefill was quicker than the hang-up


async def _bad_body(client: httpx.AsyncClient, rng: random.Random) -> str:
    path, body = rng.choice(BAD_BODIES)
    if isinstance(body, bytes):
        resp = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return _refused(resp, None)


async def _oversized(client: httpx.AsyncClient, rng: random.Random, max_model_len: int) -> str:
    words = rng.choice([2, 40]) * max_model_len  # tokenized and counted, or refused by its length alone
    prompt = " ".join(rng.choice(TOPICS) for _ in range(words // 2))
    if rng.random() < 0.5:
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    else:
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
    return _refused(resp, "context_length_exceeded")


def _refused(resp: httpx.Response, code: str | None) -> str:
    """"ok" for a 4xx with an OpenAI-style error body (and this code, if given), else what went wrong."""
    if not 400 <= resp.status_code < 500:
        return f"http {resp.status_code}"
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "not an OpenAI error"
    if not isinstance(error.get("message"), str) or "type" not in error:
        return "not an OpenAI error"
    return "ok" if code is None or error.get("code") == code else f"code {error.get('code')}"


async def _client(url: str, seed: int, deadline: float, tally: Tally, max_model_len: int, long_prompt: str,
                  progress: tqdm) -> None:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                if kind == NORMAL:
                    outcome = await _normal(client, rng, tally)
                elif kind == DISCONNECT:
                    outcome = await _disconnect(client, rng)
                elif kind == PREFILL_ABORT:
                    outcome = await _prefill_abort(client, rng, long_prompt)
                elif kind == BAD_BODY:
                    outcome = await _bad_body(client, rng)
                else:
                    outcome = await _oversized(client, rng, max_model_len)
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            tally.outcomes[(kind, outcome)] += 1
            progress.set_postfix(served=tally.served(NORMAL), lost=tally.lost(), refresh=False)


class Server:
    """`edgeserve serve` in a child process, its output in a temporary file."""

    def __init__(self, model: str, kv_memory: str, threads: int | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        threads_args = ["--threads", str(threads)] if threads else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgeserve.cli", "serve", "-m", model, "--backend", "numpy", "--kv-memory",
             kv_memory, "--prefix-cache-disk", "0", "--port", str(self.port), *threads_args],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.process = psutil.Process(self.proc.pid)
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.2)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> tuple[int, float]:
        """SIGTERM it: its exit status and how long the drain took."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60), time.monotonic() - started
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(), time.monotonic() - started


def _metric(text: str, name: str) -> float:
    """The value of one series (a name with its labels) in /metrics."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


def _series(text: str, prefix: str) -> list[str]:
    """The series in /metrics whose name and labels start with prefix."""
    return [line.rpartition(" ")[0] for line in text.splitlines() if line.startswith(prefix)]


async def _soak(server: Server, clients: int, seconds: float, seed: int) -> tuple[Tally, list[tuple[float, int]]]:
    models = httpx.get(server.url + "/v1/models").json()
    max_model_len = models["data"][0]["max_model_len"]
    long_prompt = " ".join(TOPICS[i % len(TOPICS)] for i in range(max_model_len // 4))  # about half the context
    tally = Tally()
    rss: list[tuple[float, int]] = [(0.0, server.rss())]
    start = time.monotonic()
    deadline = start + seconds
    with tqdm(total=int(seconds), unit="s", desc="soak", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s{postfix}",
              file=sys.stderr) as progress:
        tasks = [asyncio.create_task(_client(server.url, seed + i, deadline, tally, max_model_len, long_prompt,
                                             progress)) for i in range(clients)]
        while time.monotonic() < deadline:
            await asyncio.sleep(1)
            elapsed = time.monotonic() - start
            progress.n = min(int(elapsed), int(seconds))
            progress.refresh()
            if elapsed - rss[-1][0] >= 15:
                rss.append((elapsed, server.rss()))
        await asyncio.gather(*tasks)
    rss.append((time.monotonic() - start, server.rss()))
    return tally, rss


@click.command()
@click.option("--minutes", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--clients", default=16, show_default=True, type=click.IntRange(1))
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True)
@click.option("--kv-memory", default="32MiB", show_default=True, help="Small, so that the clients force preemption.")
@click.option("--threads", type=click.IntRange(1), default=None, help="The server's CPU threads.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Also print the figures as JSON, on the last line.")
def main(minutes: float, clients: int, model: str, kv_memory: str, threads: int | None, seed: int,
         as_json: bool) -> None:
    """Soak a real `edgeserve serve` with good and bad clients and report what it cost."""
    server = Server(model, kv_memory, threads)
    try:
        tally, rss = asyncio.run(_soak(server, clients, minutes * 60, seed))
        idle_deadline = time.monotonic() + 120
        while (health := httpx.get(server.url + "/health").json())["running"] + health["waiting"] > 0:
            if time.monotonic() > idle_deadline:
                break
            time.sleep(0.2)
        counts = httpx.get(server.url + "/v1/edgeserve/kv").json()["counts"]
        metrics = httpx.get(server.url + "/metrics").text
        exit_status, drain_seconds = server.stop()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.output()
    report = {
        "minutes": minutes, "clients": clients, "model": model, "kv_memory": kv_memory,
        "requests": sum(tally.outcomes.values()),
        "by_kind": {kind: dict(sorted((o, n) for (k, o), n in tally.outcomes.items() if k == kind)) for kind in MIX},
        "good_served": tally.served(NORMAL), "good_lost": tally.lost(),
        "greedy_mismatches": tally.greedy_mismatches,
        "latency_p50_s": float(np.percentile(tally.latencies, 50)) if tally.latencies else None,
        "latency_p99_s": float(np.percentile(tally.latencies, 99)) if tally.latencies else None,
        "ttft_p50_s": float(np.percentile(tally.ttfts, 50)) if tally.ttfts else None,
        "kv_blocks_leaked": counts["used"] + counts["shared"],
        "requests_left_running": health["running"] + health["waiting"],
        "preemptions": _metric(metrics, "edgeserve_preemptions_total"),
        "rss_mib": [[round(t), round(b / 2**20, 1)] for t, b in rss],
        "prefix_store_ram_mib": round(_metric(metrics, 'edgeserve_prefix_store_bytes{tier="ram"}') / 2**20, 1),
        "server_5xx": sum(_metric(metrics, name) for name in _series(metrics, 'edgeserve_http_requests_total{code="5')),
        "tracebacks_in_log": log.count("Traceback"),
        "sigterm_exit_status": exit_status, "sigterm_drain_s": round(drain_seconds, 2),
    }
    _print(report)
    if as_json:
        print(json.dumps(report))
    bad = report["good_lost"] or report["kv_blocks_leaked"] or report["server_5xx"] or exit_status != 0
    sys.exit(1 if bad else 0)


def _print(r: dict) -> None:
    print(f"soak: {r['clients']} clients for {r['minutes']:g} min on {r['model']}, KV pool {r['kv_memory']}")
    print(f"requests: {r['requests']}; good served {r['good_served']}, good lost {r['good_lost']}, "
          f"greedy answers differing from the first {r['greedy_mismatches']}")
    for kind, outcomes in r["by_kind"].items():
        print(f"  {kind:14} " + ", ".join(f"{o}: {n}" for o, n in outcomes.items()))
    if r["latency_p50_s"] is not None:
        print(f"latency of good requests: p50 {r['latency_p50_s']:.2f}s, p99 {r['latency_p99_s']:.2f}s; "
              f"stream TTFT p50 {r['ttft_p50_s'] or float('nan'):.2f}s")
    print(f"KV blocks leaked: {r['kv_blocks_leaked']}; requests left running: {r['requests_left_running']}; "
          f"preemptions: {r['preemptions']:g}; server 5xx: {r['server_5xx']}; tracebacks: {r['tracebacks_in_log']}")
    rss = r["rss_mib"]
    half = min(rss, key=lambda sample: abs(sample[0] - rss[-1][0] / 2))
    print(f"server RSS: {rss[0][1]} MiB at the start, {rss[1][1]} after {rss[1][0]}s, {half[1]} at {half[0]}s, "
          f"{rss[-1][1]} at the end ({rss[-1][1] - half[1]:+.1f} MiB over the second half); of it, the prefix "
          f"store's RAM tier holds {r['prefix_store_ram_mib']} MiB of K/V at the end (it grows to its cap first)")
    print(f"SIGTERM: exit status {r['sigterm_exit_status']} after {r['sigterm_drain_s']}s")


if __name__ == "__main__":
    main()
