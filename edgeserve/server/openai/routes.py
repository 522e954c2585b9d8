"""OpenAI's endpoints: /v1/models, /v1/chat/completions, /v1/completions and the Responses API (/v1/responses).

Each handler turns its body into prompts and SamplingParams through the engine's door, has the server
admit it as a Generation, and hands that to `responses` for its chunks or body.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np
from fastapi import APIRouter, Request

from edgeserve.sampling_params import GrammarTrigger, InvalidParamsError, SamplingParams
from edgeserve.server.errors import APIError
from edgeserve.server.json_body import JsonBodyRoute, json_answer
from edgeserve.server.openai.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ResponsesRequest,
    template_messages,
)
from edgeserve.server.openai.response_store import ResponseStore, StoredResponse
from edgeserve.server.openai.responses import ChatResponse, CompletionResponse, ResponsesAnswer, event_stream
from edgeserve.text.tool_calls import tools_grammar

if TYPE_CHECKING:
    from edgeserve.server.app import Server
    from edgeserve.server.models import ModelEntry
    from edgeserve.server.served_model import ServedModel


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s models."""
    api = _OpenAI(server)
    routes = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
    routes.add_api_route("/models", api.list_models, methods=["GET"], response_model=None)
    routes.add_api_route("/models/{model_id:path}", api.model, methods=["GET"], response_model=None)
    routes.add_api_route("/chat/completions", api.chat_completions, methods=["POST"], response_model=None)
    routes.add_api_route("/completions", api.completions, methods=["POST"], response_model=None)
    routes.add_api_route("/embeddings", api.embeddings, methods=["POST"], response_model=None)
    routes.add_api_route("/responses", api.responses, methods=["POST"], response_model=None)
    routes.add_api_route("/responses/{response_id}", api.stored_response, methods=["GET"], response_model=None)
    return routes


class _OpenAI:
    def __init__(self, server: Server):
        self.server = server
        self.stored = ResponseStore()

    @staticmethod
    async def _params(model: ServedModel, body: ChatCompletionRequest | CompletionRequest, max_tokens: int,
                      logprobs: int | None, grammar: str | None = None, trigger: GrammarTrigger | None = None,
                      in_reasoning: bool = False) -> SamplingParams:
        """The body's sampling parameters, with their grammar compiled (bound once trigger fires, or
        after the reasoning section the prompt opened); a 400 naming the field at fault."""
        try:
            params = body.sampling_params(max_tokens, logprobs, grammar, model.aengine.info.sampling_defaults, trigger)
            params = model.after_reasoning(params, in_reasoning)
            await model.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            raise APIError(400, str(exc), param=body.api_param(exc.param), code="invalid_value") from exc
        return params

    def _model(self, name: str, entry: ModelEntry) -> dict:
        """A model object, with what edgeserve adds: whether it is loaded and, while it is, its context."""
        loaded = {"max_model_len": entry.model.aengine.info.max_model_len} if entry.model is not None else {}
        return {"id": name, "object": "model", "created": self.server.started, "owned_by": "edgeserve",
                "loaded": entry.model is not None, **loaded}

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model(name, entry) for entry in self.server.models.entries
                                           for name in entry.names]}

    async def model(self, model_id: str) -> dict:
        return self._model(model_id, self.server.models.find(model_id))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> object:
        server = self.server
        model, name = await server.model(body.model)
        tools = body.offered_tools()
        ids = await model.chat_prompt([m.as_template_message() for m in body.messages], tools, "messages")
        max_tokens = body.requested_max_tokens or model.aengine.info.max_model_len  # the engine caps it at the context
        tool_format = model.aengine.tool_format
        forced = body.forced_tools() is not None
        # Under tool_choice auto the calls follow the tools' schemas too, unless the answer has a grammar of its own.
        free = all(v is None for v in body.constraint().values())
        grammar, trigger = tools_grammar(tool_format, tools if forced or free else None, forced,
                                         body.parallel_tool_calls and body.choice != "named")
        in_reasoning = model.opens_reasoning(ids)
        params = await self._params(model, body, max_tokens, body.num_logprobs, grammar, trigger, in_reasoning)
        gen = server.start(model, "chatcmpl", [ids], params, body.n, body.seed, body.stream)
        response = ChatResponse(gen, name, model.aengine.tokenizer, tool_format if tools else None,
                                reasoning=body.reasoning_format != "none", in_reasoning=in_reasoning)
        if body.stream:
            return event_stream(response.events(body.include_usage))
        await gen.wait(request)
        return await json_answer(response.body)

    async def completions(self, body: CompletionRequest, request: Request) -> object:
        server = self.server
        model, name = await server.model(body.model)
        prompts = await model.prompt_ids(body.prompts(), "prompt")
        params = await self._params(model, body, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs)
        gen = server.start(model, "cmpl", prompts, params, body.n, body.seed, body.stream)
        response = CompletionResponse(gen, name, model.aengine.tokenizer)
        if body.stream:
            return event_stream(response.events(body.include_usage))
        await gen.wait(request)
        return await json_answer(response.body)

    async def embeddings(self, body: EmbeddingRequest) -> dict:
        model, name = await self.server.model(body.model)
        vectors, tokens = await model.embed(body.inputs(), "input")
        if body.encoding_format == "base64":  # float32 little-endian, as OpenAI's client decodes it
            encoded: list = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vectors]
        else:
            encoded = vectors
        return {"object": "list", "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]}

    async def responses(self, body: ResponsesRequest, request: Request) -> object:
        server = self.server
        model, name = await server.model(body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = self.stored.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"no stored response {body.previous_response_id!r} (this server keeps the last "
                                    f"{self.stored.size} stored responses, in memory)", param="previous_response_id",
                               code="not_found")
            history = previous.conversation
        conversation = history + template_messages(body.input_items())
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools = body.offered_tools()
        ids = await model.chat_prompt(instructions + conversation, tools, "input")
        tool_format = model.aengine.tool_format
        forced = body.forced_tools() is not None
        grammar, trigger = tools_grammar(tool_format, tools if forced or body.output_schema is None else None, forced,
                                         body.parallel_tool_calls and body.choice != "named")
        max_tokens = body.max_output_tokens or model.aengine.info.max_model_len
        in_reasoning = model.opens_reasoning(ids)
        try:
            params = body.sampling_params(max_tokens, grammar, trigger, model.aengine.info.sampling_defaults)
            params = model.after_reasoning(params, in_reasoning)
            await model.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            param = {"json_schema": "text.format", "grammar": "tools"}.get(exc.param, exc.param)
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        gen = server.start(model, "resp", [ids], params, 1, None, body.stream)
        echo = body.model_dump(include={"instructions", "tools", "parallel_tool_calls", "max_output_tokens",
                                        "temperature", "top_p", "previous_response_id", "store", "metadata"})
        echo["tool_choice"] = body.tool_choice.model_dump() if body.choice == "named" else body.choice
        echo["tools"] = echo["tools"] or []
        echo["text"] = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                        if body.text and body.text.format else {"type": "text"}}

        def store(response: dict, message: dict) -> None:
            if body.store:
                self.stored.put(StoredResponse(response, [*conversation, message]))

        answer = ResponsesAnswer(gen, name, tool_format if tools else None, in_reasoning, echo, store)
        if body.stream:
            return answer.stream()
        await gen.wait(request)
        return await json_answer(answer.body)

    async def stored_response(self, response_id: str) -> dict:
        stored = self.stored.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r} (this server keeps the last {self.stored.size} "
                                "stored responses, in memory)", code="not_found")
        return stored.body
