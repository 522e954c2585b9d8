"""Compare `edgeserve serve` with llama-cpp-python's server on one GGUF file and one workload.

Each server is started in turn on a free loopback port, sent the same seeded workload by
concurrent streaming clients, and stopped. llama-cpp-python is not a dependency of edgeserve:
install it for this only (`pip install 'llama-cpp-python[server]'`).

    python bench/compare_servers.py --requests 48 --concurrency 16
    python bench/compare_servers.py --requests 32 --concurrency 16 --uniform 64 128
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import click
import httpx

from edgeserve.bench.workloads import mixed_workload, uniform_workload
from edgeserve.bench.http_driver import run_http_bench
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.models.gguf_file import read_gguf
from edgeserve.models.loader import resolve_model
from edgeserve.text.tokenizer import Tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f}s")


@click.command()
@click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True, help="Catalog name or GGUF file.")
@click.option("--requests", "num_requests", default=48, show_default=True)
@click.option("--concurrency", default=16, show_default=True)
@click.option("--max-prompt", default=256, show_default=True)
@click.option("--max-output", default=128, show_default=True)
@click.option("--uniform", type=(int, int), default=None, metavar="PROMPT OUTPUT",
              help="Every request PROMPT tokens in, OUTPUT tokens out (instead of the mixed workload).")
@click.option("--threads", default=os.cpu_count(), show_default=True, help="llama.cpp threads.")
@click.option("--kv-memory", default="1GiB", show_default=True, help="edgeserve KV pool.")
def main(model: str, num_requests: int, concurrency: int, max_prompt: int, max_output: int,
         uniform: tuple[int, int] | None, threads: int, kv_memory: str) -> None:
    gguf = str(resolve_model(model))
    tokenizer = Tokenizer.from_gguf(read_gguf(gguf).metadata)
    if uniform:
        work = uniform_workload(tokenizer, num_requests, *uniform)
    else:
        work = mixed_workload(tokenizer, n=num_requests, max_prompt=max_prompt, max_output=max_output)
    servers = {
        "edgeserve": [sys.executable, "-c", "from edgeserve.cli.main import cli; cli()", "serve", "--model", gguf,
                      "--backend", "numpy", "--kv-memory", kv_memory],
        # By default it cuts off the running request whenever another arrives; let each finish.
        "llama-cpp-python": [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "8192",
                             "--n_threads", str(threads), "--n_threads_batch", str(threads),
                             "--interrupt_requests", "False"],
    }
    rows = []
    for name, command in servers.items():
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            _wait_ready(url, proc)
            served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            result = asyncio.run(run_http_bench(url, work, concurrency, served))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        rows.append({"server": name, **result.summary()})
        click.echo(json.dumps(rows[-1]))
    keys = ["server", "requests", "output_tokens", "requested_output_tokens", "wall_s", "output_tokens_per_s",
            "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"]
    click.echo("\n" + " | ".join(keys))
    for row in rows:
        click.echo(" | ".join(str(row[k]) for k in keys))


if __name__ == "__main__":
    main()
