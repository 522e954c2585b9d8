"""Ollama's endpoints on the server's engine: /api/chat and /api/generate (NDJSON streamed by default, or one
body with `stream: false`), /api/embed (and the older /api/embeddings), /api/tags, /api/ps, /api/show,
/api/version.

Each answer ends with Ollama's counts and timings (nanoseconds): total_duration, load_duration (0: the model is
loaded), prompt_eval_count and _duration (to the first token), eval_count and _duration (the rest).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.server.errors import APIError
from edgeserve.server.generation import Generation
from edgeserve.server.ollama.protocol import (
    Body,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
)
from edgeserve.server.openai.protocol import json_or_text
from edgeserve.text.tool_stream import AnswerEvents, CallEnded, Event, ReasoningText, Text

if TYPE_CHECKING:
    from edgeserve.server.app import Server

NS = 1_000_000_000


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s engine."""
    api = _Ollama(server)
    routes = APIRouter(prefix="/api")
    routes.add_api_route("/chat", api.chat, methods=["POST"], response_model=None)
    routes.add_api_route("/generate", api.generate, methods=["POST"], response_model=None)
    routes.add_api_route("/embed", api.embed, methods=["POST"], response_model=None)
    routes.add_api_route("/embeddings", api.embeddings, methods=["POST"], response_model=None)
    routes.add_api_route("/tags", api.tags, methods=["GET"], response_model=None)
    routes.add_api_route("/ps", api.ps, methods=["GET"], response_model=None)
    routes.add_api_route("/show", api.show, methods=["POST"], response_model=None)
    routes.add_api_route("/version", api.version, methods=["GET"], response_model=None)
    return routes


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class _Ollama:
    def __init__(self, server: Server):
        self.server = server
        self.aengine = server.aengine

    def _name(self, requested: str) -> str:
        """The name answers carry, as asked (a 404 for a model not served); Ollama's default tag ":latest" may
        follow a served name."""
        base = requested.removesuffix(":latest")
        self.server.check_model(base if base in self.server.model_names else requested)
        return requested

    async def _params(self, body: Body) -> SamplingParams:
        try:
            params = body.sampling_params(self.aengine.info.sampling_defaults, self.aengine.info.max_model_len)
            await self.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            param = "format" if exc.param == "json_schema" else f"options.{exc.param}"
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc
        return params

    async def chat(self, body: ChatRequest, request: Request) -> object:
        started = time.perf_counter()
        name = self._name(body.model)
        if any(m.images for m in body.messages):
            raise APIError(400, "this model reads text only: a message holds images", param="messages")
        tools = body.tools or None
        ids = await self.server.chat_prompt([m.as_template_message() for m in body.messages], tools, "messages")
        params = await self._params(body)
        gen = self.server.start("chat", [ids], params, 1, None, body.stream)
        answer = AnswerEvents(self.aengine.tool_format if tools else None)

        def delta(events: list[Event]) -> dict | None:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(e.text for e in events
                                                                               if isinstance(e, Text))}
            if thinking := "".join(e.text for e in events if isinstance(e, ReasoningText)):
                message["thinking"] = thinking
            if ended := sum(isinstance(e, CallEnded) for e in events):
                message["tool_calls"] = [_tool_call(c) for c in answer.calls[-ended:]]
            return message if message["content"] or len(message) > 2 else None

        if body.stream:
            return _ndjson(self._stream(gen, answer, started, lambda m: {"model": name, "message": m}, delta,
                                        {"role": "assistant", "content": ""}))
        await gen.wait(request)
        answer.feed("".join(gen.choices[0].text))
        answer.finish(cut=gen.choices[0].finish_reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning_text:
            message["thinking"] = answer.reasoning_text
        if answer.calls:
            message["tool_calls"] = [_tool_call(c) for c in answer.calls]
        return {"model": name, "created_at": _now(), "message": message, **_done(gen, started)}

    async def generate(self, body: GenerateRequest, request: Request) -> object:
        started = time.perf_counter()
        name = self._name(body.model)
        if body.raw:
            (ids,) = await self.server.prompt_ids([body.prompt], "prompt")
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            ids = await self.server.chat_prompt([*system, {"role": "user", "content": body.prompt}], None, "prompt")
        params = await self._params(body)
        gen = self.server.start("gen", [ids], params, 1, None, body.stream)
        if body.stream:
            answer = AnswerEvents(None, reasoning=False)

            def delta(events: list[Event]) -> str | None:
                return "".join(e.text for e in events if isinstance(e, Text)) or None

            return _ndjson(self._stream(gen, answer, started, lambda text: {"model": name, "response": text}, delta,
                                        ""))
        await gen.wait(request)
        return {"model": name, "created_at": _now(), "response": "".join(gen.choices[0].text),
                **_done(gen, started)}

    async def embed(self, body: EmbedRequest) -> dict:
        started = time.perf_counter()
        name = self._name(body.model)
        if isinstance(body.input, list) and not body.input:
            raise APIError(400, "input must not be an empty list", param="input")
        vectors, tokens = await self.server.embed([body.input] if isinstance(body.input, str) else body.input, "input")
        return {"model": name, "embeddings": vectors, "total_duration": int((time.perf_counter() - started) * NS),
                "load_duration": 0, "prompt_eval_count": tokens}

    async def embeddings(self, body: EmbeddingsRequest) -> dict:
        self._name(body.model)
        vectors, _ = await self.server.embed([body.prompt], "prompt")
        return {"embedding": vectors[0]}

    async def _stream(self, gen: Generation, answer: AnswerEvents, started: float, shape: Callable[[Any], dict],
                      delta: Callable[[list[Event]], Any], last: Any) -> AsyncIterator[dict]:
        """The chunks of an answer as it comes (shape(delta(events)) where delta has something), then the closing
        one, shape(last), with its counts and timings."""
        async for choice, out in gen.outputs():
            events = answer.feed(out.text)
            if out.finished:
                events += answer.finish(cut=out.finish_reason == "length")
            if (part := delta(events)) is not None:
                yield {**shape(part), "created_at": _now(), "done": False}
        yield {**shape(last), "created_at": _now(), **_done(gen, started)}

    def _details(self) -> dict:
        info = self.aengine.info
        return {"format": info.model_format, "family": info.architecture, "families": [info.architecture],
                "parameter_size": f"{info.num_parameters / 1e9:.2f}B" if info.num_parameters >= 1e9
                else f"{info.num_parameters / 1e6:.0f}M", "quantization_level": info.quantization}

    def _entry(self, name: str) -> dict:
        return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(self.server.started, timezone.utc)
                .isoformat().replace("+00:00", "Z"), "size": self.aengine.info.memory_bytes, "digest": "",
                "details": self._details()}

    async def tags(self) -> dict:
        return {"models": [self._entry(name) for name in self.server.listed_names]}

    async def ps(self) -> dict:
        # one model, loaded for the server's life: it never expires
        return {"models": [{**self._entry(name), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": self.aengine.info.max_model_len}
                           for name in self.server.listed_names]}

    async def show(self, body: ShowRequest) -> dict:
        self._name(body.model)
        info = self.aengine.info
        capabilities = ["completion", *(["tools"] if self.aengine.tool_format is not None else [])]
        return {"modelfile": "", "parameters": "\n".join(f"{k} {v}" for k, v in info.sampling_defaults.settings.items()),
                "template": "", "details": self._details(), "capabilities": capabilities,
                "model_info": {"general.architecture": info.architecture, "general.parameter_count": info.num_parameters,
                               f"{info.architecture}.context_length": info.context_len}}

    async def version(self) -> dict:
        return {"version": version("edgeserve")}


def _tool_call(call: Any) -> dict:
    arguments = json_or_text(call.arguments)
    return {"function": {"name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _done(gen: Generation, started: float) -> dict:
    """The closing fields: why it ended, and Ollama's counts and timings."""
    c = gen.choices[0]
    ttft = c.ttft or 0.0
    return {"done": True, "done_reason": "length" if c.finish_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - started) * NS), "load_duration": 0,
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
