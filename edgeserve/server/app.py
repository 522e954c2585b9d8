"""The HTTP server: `create_app` wires the models' engines to the API families' routes, the middleware and the
error handlers; `Server` is what every route shares: the models (`ModelPool`), admission and the requests running.

Every request becomes one engine request per choice, so all clients of a model share its continuous batcher.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Iterable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.sampling_params import SamplingParams
from edgeserve.server import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_QUEUE, anthropic, llama_cpp, ollama, openai, status
from edgeserve.server.errors import APIError, add_error_handlers
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.metrics import ServerMetrics
from edgeserve.server.middleware import Gate, HostGuard, host_name
from edgeserve.server.models import ModelPool
from edgeserve.server.served_model import ServedModel
from edgeserve.server.web import add_web_chat

logger = logging.getLogger("edgeserve.server")


class Server:
    """What the routes share: the models, admission (the queue limit, 503 while draining), the requests running,
    and the metrics they leave."""

    def __init__(self, models: ModelPool, max_queue: int):
        self.models = models
        self.max_queue = max_queue
        self.max_share = max(1, max_queue // 2)  # the most generations one request may run: the rest is for others
        self.in_flight = 0  # engine requests submitted through this server and not yet ended
        self.open_requests = 0  # API requests between arriving and their answer's last byte
        self.live: set[Generation] = set()
        self.draining = False  # shutting down: running requests go on, new ones get 503
        self.metrics = ServerMetrics()
        self.started = int(time.time())

    @property
    def model_name(self) -> str:
        """The default model's name."""
        return self.models.default.name

    async def model(self, requested: str | None, keep_alive: float | None = None) -> tuple[ServedModel, str]:
        """The model a request names, leased for the request (loaded first where it is not), and the name its
        answer carries: the one the request gave (an alias stays the alias), else the model's; 404 for a name this
        server does not serve."""
        entry = self.models.find(requested)
        return await self.models.acquire(entry, keep_alive), requested or entry.name

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry later",
                           "server_error", code="server_shutting_down")

    # running ------------------------------------------------------------------

    def start(self, model: ServedModel, prefix: str, prompts: list[list[int]], params: SamplingParams, n: int,
              seed: int | None, stream: bool) -> Generation:
        """Admit the request (or raise 429 or 503) and submit n engine requests per prompt to the model.

        Choice i of a prompt samples with seed + i where a seed is given, so the n answers differ.
        """
        self.check_open()  # again: it may have been tokenizing or compiling when the shutdown began
        count = len(prompts) * n
        if count > self.max_share:  # retrying cannot help it, and it would shut everyone else out
            raise APIError(400, f"this request asks for {count} generations ({len(prompts)} prompts x n={n}); one "
                                f"request may run at most {self.max_share} at once here", param="n",
                           code="invalid_value")
        if self.in_flight + count > self.max_queue:
            raise APIError(429, f"the server is busy: {self.in_flight} requests in flight, the limit is "
                                f"{self.max_queue}; retry later", "rate_limit_error", code="queue_full")
        response_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        choices = []
        for p, ids in enumerate(prompts):
            for i in range(n):
                index = p * n + i
                seeded = params if seed is None else dataclasses.replace(params, seed=seed + i)
                choices.append(Choice(index, f"{response_id}-{index}", ids, seeded))
        self.in_flight += count
        gen = Generation(model.aengine, response_id, choices, n, sum(len(ids) for ids in prompts), stream,
                         self.account)
        self.live.add(gen)
        return gen

    def abort_all(self) -> None:
        """End every running request now (finish_reason "abort"), e.g. when the server shuts down.

        Safe to call from a signal handler: it only queues aborts for the engine thread.
        """
        for gen in list(self.live):
            for choice in gen.choices:
                gen.aengine.abort(choice.request_id)

    def account(self, gen: Generation) -> None:
        """Called once when every choice of a request has ended."""
        self.live.discard(gen)
        self.in_flight -= len(gen.choices)
        m = self.metrics
        m.prompt_tokens += gen.prompt_tokens
        for c in gen.choices:
            m.observe_choice(c.finish_reason or "disconnect", c.completion_tokens, c.ttft, c.elapsed)
        completion = gen.completion_tokens
        ttfts = [c.ttft for c in gen.choices if c.ttft is not None]
        elapsed = max(c.elapsed for c in gen.choices)
        outcome = ",".join(sorted({c.finish_reason or "disconnect" for c in gen.choices}))
        # cached: prompt tokens from the prefix cache (of which those loaded from the prefix store's RAM and
        # disk tiers); diverged: the first token no cached prefix had (a client changing an early token, such as
        # a timestamp, shows as a small offset here)
        diverged = gen.prefix_diverged_at
        tiers = gen.tier_cached_tokens
        logger.info("%s prompt=%d cached=%d diverged=%s cached_ram=%d cached_disk=%d completion=%d ttft=%s %.1f tok/s "
                    "status=%s", gen.response_id, gen.prompt_tokens, gen.cached_tokens,
                    "-" if diverged is None else diverged, tiers.get("ram", 0), tiers.get("disk", 0), completion,
                    f"{min(ttfts):.3f}s" if ttfts else "-", completion / elapsed if elapsed > 0 else 0.0, outcome)


def create_app(models: AsyncEngine | ModelPool, model_name: str = "", api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               allowed_hosts: Iterable[str] = (), aliases: Iterable[str] = (),
               cors_origins: Iterable[str] = (), web: bool = True) -> FastAPI:
    """The server app, on a pool of models, or on one loaded engine whose id clients pass as `model` is
    `model_name` (the catalog name and `aliases` work too).

    Host headers must name loopback, an IP address, or one of `allowed_hosts` ("*" allows any). Web pages from
    `cors_origins` ("*": any) may call the API from a browser; the API key still applies to their requests.
    `web` serves the web chat at /.
    """
    pool = models if isinstance(models, ModelPool) else ModelPool.single(models, model_name, aliases)
    server = Server(pool, max_queue)
    app = FastAPI(title="edgeserve", description="OpenAI-, Anthropic- and Ollama-compatible local LLM server")
    app.state.server = server
    # The last added runs first: Gate outermost, so its count of answers includes the guard's.
    app.add_middleware(HostGuard, allowed_hosts=frozenset(host_name(h) if h != "*" else h for h in allowed_hosts),
                       max_body_size=max_body_size)
    app.add_middleware(Gate, server=server, api_key=api_key)
    if origins := list(dict.fromkeys(cors_origins)):
        # outermost: a browser's preflight carries no key, and every answer (a 401 too) needs the headers
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["*"], max_age=600)
    add_error_handlers(app)
    app.include_router(openai.router(server))
    app.include_router(anthropic.router(server))
    app.include_router(status.router(server))
    app.include_router(llama_cpp.router(server))
    app.include_router(ollama.router(server))
    if web:
        add_web_chat(app)
    return app
