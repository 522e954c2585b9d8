"""OpenAI's endpoints: /v1/models, /v1/chat/completions and /v1/completions.

Each handler turns its body into prompts and SamplingParams through the engine's door, has the server
admit it as a Generation, and hands that to `responses` for its chunks or body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from edgeserve.sampling_params import InvalidParamsError, SamplingParams
from edgeserve.server.errors import APIError
from edgeserve.server.openai.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from edgeserve.server.openai.responses import ChatResponse, CompletionResponse, event_stream

if TYPE_CHECKING:
    from edgeserve.server.app import Server


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s engine."""
    api = _OpenAI(server)
    routes = APIRouter(prefix="/v1")
    routes.add_api_route("/models", api.list_models, methods=["GET"], response_model=None)
    routes.add_api_route("/chat/completions", api.chat_completions, methods=["POST"], response_model=None)
    routes.add_api_route("/completions", api.completions, methods=["POST"], response_model=None)
    return routes


class _OpenAI:
    def __init__(self, server: Server):
        self.server = server
        self.aengine = server.aengine

    async def _params(self, body: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None,
                      grammar: str | None = None) -> SamplingParams:
        """The body's sampling parameters, with their grammar compiled; a 400 naming the field at fault."""
        try:
            params = body.sampling_params(max_tokens, logprobs, grammar, self.aengine.info.sampling_defaults)
            await self.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            raise APIError(400, str(exc), param=body.api_param(exc.param), code="invalid_value") from exc
        return params

    async def list_models(self) -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.server.started, "owned_by": "edgeserve",
            "max_model_len": self.aengine.info.max_model_len,
        } for name in self.server.listed_names]}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> object:
        server = self.server
        server.check_model(body.model)
        tools = body.offered_tools()
        ids = await server.chat_prompt([m.as_template_message() for m in body.messages], tools, "messages")
        max_tokens = body.requested_max_tokens or self.aengine.info.max_model_len  # the engine caps it at the context
        tool_format = self.aengine.tool_format
        forced = body.forced_tools()
        grammar = None
        if forced:
            grammar = tool_format.grammar(forced, body.parallel_tool_calls and body.choice == "required")
        params = await self._params(body, max_tokens, body.num_logprobs, grammar)
        gen = server.start("chatcmpl", [ids], params, body.n, body.seed, body.stream)
        response = ChatResponse(gen, server.model_name, self.aengine.tokenizer, tool_format if tools else None,
                                reasoning=body.reasoning_format != "none", in_reasoning=server.opens_reasoning(ids))
        if body.stream:
            return event_stream(response.events(body.include_usage))
        await gen.wait(request)
        return response.body()

    async def completions(self, body: CompletionRequest, request: Request) -> object:
        server = self.server
        server.check_model(body.model)
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                server.check_text_length(len(p), "prompt")
                ids = await self.aengine.tokenize(p)
            else:
                ids = list(p)
            server.check_prompt(ids, "prompt")
            prompts.append(ids)
        params = await self._params(body, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs)
        gen = server.start("cmpl", prompts, params, body.n, body.seed, body.stream)
        response = CompletionResponse(gen, server.model_name, self.aengine.tokenizer)
        if body.stream:
            return event_stream(response.events(body.include_usage))
        await gen.wait(request)
        return response.body()
