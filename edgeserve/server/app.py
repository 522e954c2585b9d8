"""The OpenAI-compatible HTTP server: a FastAPI app in front of one shared AsyncEngine.

Every request becomes one engine request per choice, so all clients share the continuous batcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.text.chat_template import ChatTemplateError
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.models.catalog import CATALOG
from edgeserve.sampling_params import InvalidParamsError
from edgeserve.server import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_QUEUE
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.metrics import ServerMetrics
from edgeserve.text.tool_calls import ToolCallStream
from edgeserve.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    error_body,
    sse,
)

# A token spells at most a few dozen characters in any real vocabulary, so a text this many times
# longer than the context cannot fit whatever it says: refused before paying to tokenize it.
MAX_CHARS_PER_TOKEN = 32
# Loopback names a DNS-rebinding page cannot take over; IP literals are checked apart.
LOOPBACK_HOSTS = frozenset({"localhost"})

logger = logging.getLogger("edgeserve.server")


class _Server:
    def __init__(self, aengine: AsyncEngine, model_name: str, api_key: str | None, max_queue: int,
                 aliases: Iterable[str] = ()):
        self.aengine = aengine
        self.engine = aengine.engine
        self.tokenizer = aengine.tokenizer
        self.model_name = model_name
        source = self.engine.model.source.name
        self.model_names = {model_name} | {e.name for e in CATALOG.values() if e.filename == source}
        self.aliases = [a for a in dict.fromkeys(aliases) if a != model_name]  # more names /v1/models lists
        self.model_names |= set(self.aliases)
        self.api_key = api_key
        self.max_queue = max_queue
        self.in_flight = 0  # engine requests submitted through this server and not yet ended
        self.live: set[Generation] = set()
        self.draining = False  # shutting down: running requests go on, new ones get 503
        self.metrics = ServerMetrics()
        self.started = int(time.time())

    # checks -------------------------------------------------------------------

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.model_names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise APIError(400, f"{param} holds token ids outside the vocabulary (0..{self.tokenizer.vocab_size - 1})",
                           param=param, code="invalid_value")
        try:
            self.engine.check_prompt(ids)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from exc
        except EdgeserveError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse text too long for the context at any tokenization, before tokenizing it."""
        limit = MAX_CHARS_PER_TOKEN * self.engine.max_model_len
        if chars > limit:
            raise APIError(400, f"{param} has {chars} characters, far more than the model's context of "
                                f"{self.engine.max_model_len} tokens can hold", param=param,
                           code="context_length_exceeded")

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry later",
                           "server_error", code="server_shutting_down")

    def authorized(self, headers: Headers) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    # running ------------------------------------------------------------------

    async def start(self, prefix: str, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                    max_tokens: int, logprobs: int | None, grammar: str | None = None) -> Generation:
        """Admit the request (or raise 429 or 503) and submit one engine request per prompt and choice.

        grammar: a Lark grammar the answer must follow (forced tool calls).
        """
        try:
            params = body.sampling_params(max_tokens, logprobs, grammar)
            params.check_vocab(self.engine.vocab_size)
            # Off the event loop: a large grammar takes a while to compile (once; the engine reuses it).
            await asyncio.to_thread(self.engine.constraints.compile, params)
        except InvalidParamsError as exc:
            raise APIError(400, str(exc), param=body.api_param(exc.param), code="invalid_value") from exc
        self.check_open()  # again: it may have been tokenizing or compiling when the shutdown began
        count = len(prompts) * body.n
        if self.in_flight + count > self.max_queue:
            raise APIError(429, f"the server is busy: {self.in_flight} requests in flight, the limit is "
                                f"{self.max_queue}; retry later", "rate_limit_error", code="queue_full")
        response_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        choices = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                index = p * body.n + i
                seeded = params if body.seed is None else dataclasses.replace(params, seed=body.seed + i)
                choices.append(Choice(index, f"{response_id}-{index}", ids, seeded))
        self.in_flight += count
        gen = Generation(self.aengine, response_id, choices, body.n, sum(len(ids) for ids in prompts), body.stream,
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
        completion = sum(c.completion_tokens for c in gen.choices)
        ttfts = [c.ttft for c in gen.choices if c.ttft is not None]
        elapsed = max(c.elapsed for c in gen.choices)
        status = ",".join(sorted({c.finish_reason or "disconnect" for c in gen.choices}))
        logger.info("%s prompt=%d completion=%d ttft=%s %.1f tok/s status=%s", gen.response_id, gen.prompt_tokens,
                    completion, f"{min(ttfts):.3f}s" if ttfts else "-",
                    completion / elapsed if elapsed > 0 else 0.0, status)

    # endpoints ----------------------------------------------------------------

    async def list_models(self) -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.started, "owned_by": "edgeserve",
            "max_model_len": self.engine.max_model_len,
        } for name in (self.model_name, *self.aliases)]}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> object:
        self.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        tools = body.offered_tools()
        try:
            # Off the event loop: a long prompt takes seconds to render and tokenize.
            ids = await asyncio.to_thread(self.engine.chat_prompt_ids, messages, True, tools)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        self.check_prompt(ids, "messages")
        max_tokens = body.requested_max_tokens or self.engine.max_model_len  # the engine caps it at the context
        tool_format = self.engine.chat_template.tool_format
        forced = body.forced_tools()
        grammar = tool_format.grammar(forced, body.parallel_tool_calls and body.choice == "required") if forced else None
        gen = await self.start("chatcmpl", body, [ids], max_tokens, body.num_logprobs, grammar)
        for c in gen.choices if tools else ():
            c.tool_stream = ToolCallStream(tool_format)
        if body.stream:
            return _event_stream(self._chat_events(gen, body.include_usage))
        await gen.wait(request)
        choices = [{
            "index": c.index,
            "message": c.message(),
            "logprobs": chat_logprobs(c.logprobs, self.tokenizer) if c.params.logprobs is not None else None,
            "finish_reason": c.chat_finish_reason,
        } for c in gen.choices]
        return envelope(gen.response_id, "chat.completion", gen.created, self.model_name, choices,
                        usage=gen.usage())

    async def completions(self, body: CompletionRequest, request: Request) -> object:
        self.check_model(body.model)
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                self.check_text_length(len(p), "prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, p)  # off the event loop, as for chat
            else:
                ids = list(p)
            self.check_prompt(ids, "prompt")
            prompts.append(ids)
        gen = await self.start("cmpl", body, prompts, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs)
        if body.stream:
            return _event_stream(self._completion_events(gen, body.include_usage))
        await gen.wait(request)
        choices = [{
            "index": c.index,
            "text": "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs, self.tokenizer, 0) if c.params.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        } for c in gen.choices]
        return envelope(gen.response_id, "text_completion", gen.created, self.model_name, choices, usage=gen.usage())

    async def _chat_events(self, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope(gen.response_id, "chat.completion.chunk", gen.created, self.model_name, [choice],
                                **extra))

        for c in gen.choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for c, out in gen.outputs():
            want_logprobs = c.params.logprobs is not None and out.logprobs
            delta = c.chat_delta(out)
            if delta or want_logprobs or out.finished:
                yield chunk(c.index, delta, chat_logprobs(out.logprobs, self.tokenizer) if want_logprobs else None,
                            c.chat_finish_reason if out.finished else None)
        if include_usage:
            yield sse(envelope(gen.response_id, "chat.completion.chunk", gen.created, self.model_name, [],
                               usage=gen.usage()))

    async def _completion_events(self, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        async for c, out in gen.outputs():
            logprobs = None
            if c.params.logprobs is not None and out.logprobs:
                logprobs = completion_logprobs(out.logprobs, self.tokenizer, c.logprob_offset)
                c.logprob_offset += sum(len(t) for t in logprobs["tokens"])
            if out.text or logprobs or out.finished:
                choice = {"index": c.index, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason if out.finished else None}
                yield sse(envelope(gen.response_id, "text_completion", gen.created, self.model_name, [choice],
                                   **extra))
        if include_usage:
            yield sse(envelope(gen.response_id, "text_completion", gen.created, self.model_name, [],
                               usage=gen.usage()))

    async def health(self) -> dict | JSONResponse:
        if not self.aengine.alive:
            return JSONResponse({"status": "error", "model": self.model_name, "error": self.aengine.error},
                                status_code=503)
        if self.draining:
            return JSONResponse({"status": "draining", "model": self.model_name, "running": len(self.live)},
                                status_code=503)
        stats = self.aengine.stats()
        return {"status": "ok", "model": self.model_name, "running": stats.running, "waiting": stats.waiting}

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(self.aengine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv(self) -> dict:
        blocks = await self.aengine.kv_map()
        counts = Counter(state for state, _ in blocks)
        return {
            "block_size": self.engine.pool_size.block_size,
            "num_blocks": len(blocks),
            "counts": {s: counts.get(s, 0) for s in ("free", "cached", "used", "shared")},
            "blocks": [{"state": state, "owners": owners} for state, owners in blocks],
        }


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events: the given ones, an error event if generation fails midway, then [DONE]."""

    async def stream() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the status line has gone out already: tell the client in the stream
            logger.error("stream failed: %s", exc)
            yield sse(error_body(f"generation failed: {exc}", "server_error"))
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Gate:
    """ASGI middleware for /v1: the API-key check, 503 while shutting down, and a count of answers by status code.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap streaming responses
    and change how client disconnects reach them.
    """

    def __init__(self, app: ASGIApp, server: _Server):
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.server.metrics.http_requests[str(message["status"])] += 1
            await send(message)

        if not self.server.authorized(Headers(scope=scope)):
            error = APIError(401, "missing or incorrect API key; send it as 'Authorization: Bearer KEY'",
                             code="invalid_api_key")
            await error.response()(scope, receive, counting_send)
            return
        try:
            self.server.check_open()
        except APIError as closed:
            await closed.response()(scope, receive, counting_send)
            return
        await self.app(scope, receive, counting_send)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header names this server: loopback, an IP address, or an allowed name.

    DNS rebinding needs a name the attacker controls, so IP literals are safe; names must be known.
    """
    name = _host_name(host)
    if "*" in allowed or not name or name in LOOPBACK_HOSTS or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Guard:
    """ASGI middleware for every request: refuses unknown Host names (DNS rebinding), and bodies over the limit.

    The body is read here, counted, and replayed to the app, so a chunked body cannot dodge the limit.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str], max_body_size: int):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if not _host_allowed(host, self.allowed_hosts):
            error = APIError(403, f"the Host {_host_name(host)!r} is not allowed; start the server with "
                                  "--allowed-host NAME to accept it", code="host_not_allowed")
            await error.response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                first = message
                break
            size += len(message.get("body", b""))
            if size <= self.max_body_size:
                chunks.append(message.get("body", b""))
            # Over the limit the rest is drained, not kept: answering before the client has sent it
            # all would reset the connection under its feet. Past 16 times the limit it is cut off.
            if not message.get("more_body", False) or size > 16 * self.max_body_size:
                break
        if size > self.max_body_size:
            error = APIError(413, f"the request body is {size} bytes or more; the limit is {self.max_body_size} "
                                  "(--max-body-size)", code="request_too_large")
            await error.response()(scope, receive, send)
            return
        pending = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # In a union each branch reports; a value of the right type that is wrong says more than the
    # other branches' type mismatches.
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "missing":
        code = "missing_required_parameter"
    elif first["type"].endswith("_type"):
        code = "invalid_type"
    else:
        code = "invalid_value"
    # Leading with the chosen error; union branches' tags ("list[ContentPart]") are not field names.
    ordered = [first, *(e for e in errors if e is not first)][:3]
    details = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body' and '[' not in str(p)) or 'body'}: {e['msg']}"
        for e in ordered)
    return APIError(400, f"invalid request: {details}", param=loc[0] if loc else None, code=code)


def create_app(aengine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               allowed_hosts: Iterable[str] = (), aliases: Iterable[str] = ()) -> FastAPI:
    """The server app; `model_name` is the id clients pass as `model` (the catalog name and `aliases` work too).

    Host headers must name loopback, an IP address, or one of `allowed_hosts` ("*" allows any).
    """
    server = _Server(aengine, model_name, api_key, max_queue, aliases)
    app = FastAPI(title="edgeserve", description="OpenAI-compatible local LLM server")
    app.state.server = server
    # The last added runs first: _Gate outermost, so its count of answers includes the guard's.
    app.add_middleware(_Guard, allowed_hosts=frozenset(_host_name(h) if h != "*" else h for h in allowed_hosts),
                       max_body_size=max_body_size)
    app.add_middleware(_Gate, server=server)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
                        ).response()

    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/models", server.list_models, methods=["GET"], response_model=None)
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"], response_model=None)
    v1.add_api_route("/completions", server.completions, methods=["POST"], response_model=None)
    v1.add_api_route("/edgeserve/kv", server.kv, methods=["GET"], response_model=None)
    app.include_router(v1)
    app.add_api_route("/health", server.health, methods=["GET"], response_model=None)
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"], response_model=None)
    return app
