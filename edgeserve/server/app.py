"""The HTTP server: `create_app` wires one engine's door to the API families' routes, the middleware and the
error handlers; `Server` is what every route shares: the door, the served names, admission and the
requests running.

Every request becomes one engine request per choice, so all clients share the continuous batcher.
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
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.models.catalog import CATALOG
from edgeserve.sampling_params import SamplingParams
from edgeserve.server import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_QUEUE, anthropic, llama_cpp, ollama, openai, status
from edgeserve.server.errors import APIError, add_error_handlers
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.metrics import ServerMetrics
from edgeserve.server.middleware import Gate, HostGuard, host_name
from edgeserve.text.chat_template import ChatTemplateError
from edgeserve.text.tool_calls import after_reasoning
from edgeserve.text.tool_stream import opens_reasoning

# A token spells at most a few dozen characters in any real vocabulary, so a text this many times
# longer than the context cannot fit whatever it says: refused before paying to tokenize it.
MAX_CHARS_PER_TOKEN = 32
REASONING_TAIL_TOKENS = 8  # enough of a prompt's end to hold "<think>" and the newlines around it

logger = logging.getLogger("edgeserve.server")


class Server:
    """The engine's door and what the routes share: the names served, admission (the queue limit, 503 while
    draining), the requests running, and the metrics they leave."""

    def __init__(self, aengine: AsyncEngine, model_name: str, max_queue: int, aliases: Iterable[str] = ()):
        self.aengine = aengine
        self.model_name = model_name
        source = aengine.info.model_name
        self.aliases = [a for a in dict.fromkeys(aliases) if a != model_name]  # more names /v1/models lists
        self.model_names = {model_name, *self.aliases} | {e.name for e in CATALOG.values() if e.filename == source}
        self.max_queue = max_queue
        self.in_flight = 0  # engine requests submitted through this server and not yet ended
        self.live: set[Generation] = set()
        self.draining = False  # shutting down: running requests go on, new ones get 503
        self.metrics = ServerMetrics()
        self.started = int(time.time())

    @property
    def listed_names(self) -> list[str]:
        """The names a model list shows: the served name, then the aliases."""
        return [self.model_name, *self.aliases]

    # checks -------------------------------------------------------------------

    def check_model(self, requested: str | None) -> str:
        """The name an answer carries: the one the request gave (an alias stays the alias), else the served
        name; a 404 for a name this server does not serve."""
        if requested is None:
            return self.model_name
        if requested not in self.model_names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return requested

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse text too long for the context at any tokenization, before tokenizing it."""
        context = self.aengine.info.max_model_len
        if chars > MAX_CHARS_PER_TOKEN * context:
            raise APIError(400, f"{param} has {chars} characters, far more than the model's context of "
                                f"{context} tokens can hold", param=param, code="context_length_exceeded")

    def check_prompt(self, ids: list[int], param: str) -> None:
        """A 400 naming param where the prompt holds ids the tokenizer does not know, or cannot run (too long for
        the context or the pool)."""
        vocab = self.aengine.tokenizer.vocab_size  # the API speaks the tokenizer's ids, not the model's padding
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param} holds token ids outside the vocabulary (0..{vocab - 1})",
                           param=param, code="invalid_value")
        try:
            self.aengine.check_prompt(ids)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        except EdgeserveError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc

    async def prompt_ids(self, inputs: list[str | list[int]], param: str) -> list[list[int]]:
        """Plain prompts (texts, tokenized as the model wants, or token ids) as token ids; a 400 naming param where
        one cannot run."""
        prompts = []
        for item in inputs:
            if isinstance(item, str):
                self.check_text_length(len(item), param)
                ids = await self.aengine.tokenize(item)
            else:
                ids = list(item)
            self.check_prompt(ids, param)
            prompts.append(ids)
        return prompts

    async def embed(self, inputs: list[str | list[int]], param: str) -> tuple[list[list[float]], int]:
        """Unit-length embeddings of the inputs (texts or token ids), batched in one forward pass, and the tokens
        they took; a 400 naming param where an input cannot run or all do not fit the KV pool at once."""
        prompts = await self.prompt_ids(inputs, param)
        try:
            vectors = await self.aengine.embed(prompts)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        return vectors.tolist(), sum(len(p) for p in prompts)

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None, param: str) -> list[int]:
        """Template messages (and tools) as prompt ids through the model's chat template; a 400 naming param where
        they cannot render or run."""
        self.check_text_length(sum(len(m["content"]) for m in messages), param)
        try:
            ids = await self.aengine.chat_prompt(messages, tools)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        self.check_prompt(ids, param)
        return ids

    def opens_reasoning(self, ids: list[int]) -> bool:
        """Whether a rendered prompt opened a reasoning section for the answer (its last tokens say)."""
        return opens_reasoning(self.aengine.tokenizer.decode(ids[-REASONING_TAIL_TOKENS:]))

    @staticmethod
    def after_reasoning(params: SamplingParams, in_reasoning: bool) -> SamplingParams:
        """params, their grammar (JSON or Lark) binding only once the reasoning section the prompt opened ends (a
        grammar with a trigger waits for it anyway)."""
        constraint = params.constraint
        waits = params.grammar_trigger is not None
        grammar = after_reasoning(*constraint) if in_reasoning and constraint is not None and not waits else None
        return params if grammar is None else dataclasses.replace(params, json_schema=None, grammar=grammar)

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry later",
                           "server_error", code="server_shutting_down")

    # running ------------------------------------------------------------------

    def start(self, prefix: str, prompts: list[list[int]], params: SamplingParams, n: int, seed: int | None,
              stream: bool) -> Generation:
        """Admit the request (or raise 429 or 503) and submit n engine requests per prompt.

        Choice i of a prompt samples with seed + i where a seed is given, so the n answers differ.
        """
        self.check_open()  # again: it may have been tokenizing or compiling when the shutdown began
        count = len(prompts) * n
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
        gen = Generation(self.aengine, response_id, choices, n, sum(len(ids) for ids in prompts), stream,
                         self.account)
        self.live.add(gen)
        return gen

    def abort_all(self) -> None:
        """End every running request now (finish_reason "abort"), e.g. when the server shuts down.

        Safe to call from a signal handler: it only queues aborts for the engine thread.
        """
        for gen in list(self.live):
            for choice in gen.choices:
                self.aengine.abort(choice.request_id)

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
        logger.info("%s prompt=%d completion=%d ttft=%s %.1f tok/s status=%s", gen.response_id, gen.prompt_tokens,
                    completion, f"{min(ttfts):.3f}s" if ttfts else "-",
                    completion / elapsed if elapsed > 0 else 0.0, outcome)


def create_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               allowed_hosts: Iterable[str] = (), aliases: Iterable[str] = (),
               cors_origins: Iterable[str] = ()) -> FastAPI:
    """The server app; `model_name` is the id clients pass as `model` (the catalog name and `aliases` work too).

    Host headers must name loopback, an IP address, or one of `allowed_hosts` ("*" allows any). Web pages from
    `cors_origins` ("*": any) may call the API from a browser; the API key still applies to their requests.
    """
    server = Server(aengine, model_name, max_queue, aliases)
    app = FastAPI(title="edgeserve", description="OpenAI- and Anthropic-compatible local LLM server")
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
    return app
