"""Benchmarking any OpenAI-compatible server: a workload sent as streaming text completions over HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from tqdm import tqdm

from edgeserve.bench.workloads import BenchRequest, BenchResult, RequestTiming
from edgeserve.errors import EdgeserveError


def api_base(url: str) -> str:
    """'http://host:port', '.../' or '.../v1' -> 'http://host:port/v1'."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def run_http_bench(url: str, requests: list[BenchRequest], concurrency: int, model: str,
                         api_key: str | None = None, progress: bool = True,
                         temperature: float = 0.0) -> BenchResult:
    """Send every request with at most `concurrency` in flight; time each from send to first and last token."""
    base = api_base(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timings: dict[int, RequestTiming] = {}
    pending = iter(enumerate(requests))
    with tqdm(total=len(requests), unit="req", desc=f"{concurrency} clients", disable=not progress) as bar:
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(600.0, connect=10.0)) as client:

            async def client_loop() -> None:
                for i, req in pending:  # shared by all loops: each takes the next request when it is free
                    timings[i] = await _timed_request(client, model, req, temperature)
                    bar.update()

            start = time.perf_counter()
            try:
                await asyncio.gather(*(client_loop() for _ in range(concurrency)))
            except httpx.TransportError as exc:
                raise EdgeserveError(f"cannot reach {base}: {exc}") from exc
            wall = time.perf_counter() - start
    ordered = [timings[i] for i in range(len(requests))]
    # A server that stops early (ignoring ignore_eos/min_tokens) shows here as fewer output tokens.
    extra = {"concurrency": concurrency, "requested_output_tokens": sum(r.max_tokens for r in requests)}
    return BenchResult(f"http {base}", ordered, wall, extra)


async def _timed_request(client: httpx.AsyncClient, model: str, req: BenchRequest,
                         temperature: float) -> RequestTiming:
    body = {
        "model": model,
        "prompt": req.prompt_text,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Fixed output lengths, so every server does the same work: vLLM, llama.cpp's server and
        # edgeserve read ignore_eos; llama-cpp-python reads min_tokens.
        "ignore_eos": True,
        "min_tokens": req.max_tokens,
    }
    start = time.perf_counter()
    ttft = None
    text_chunks = 0
    usage = None
    async with client.stream("POST", "/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise EdgeserveError(f"{client.base_url} answered {resp.status_code}: {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise EdgeserveError(f"{client.base_url} failed a request: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    text_chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    latency = time.perf_counter() - start
    # Servers without stream usage send one chunk per token, so the chunks count the tokens.
    output_tokens = usage["completion_tokens"] if usage else text_chunks
    prompt_tokens = usage["prompt_tokens"] if usage else len(req.prompt_ids)
    return RequestTiming(prompt_tokens, output_tokens, latency if ttft is None else ttft, latency)
