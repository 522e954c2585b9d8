"""Anthropic's endpoints: POST /v1/messages and /v1/messages/count_tokens.

Each handler renders its conversation through the model's chat template (`ServedModel.chat_prompt`), has the server
admit it as a Generation, and hands that to `responses` for its events or body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from edgeserve.sampling_params import InvalidParamsError
from edgeserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from edgeserve.server.anthropic.responses import MessageResponse, event_stream
from edgeserve.server.errors import APIError
from edgeserve.server.json_body import JsonBodyRoute, json_answer
from edgeserve.text.tool_calls import tools_grammar

if TYPE_CHECKING:
    from edgeserve.server.app import Server


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s models."""
    api = _Anthropic(server)
    routes = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
    routes.add_api_route("/messages", api.messages, methods=["POST"], response_model=None)
    routes.add_api_route("/messages/count_tokens", api.count_tokens, methods=["POST"], response_model=None)
    return routes


class _Anthropic:
    def __init__(self, server: Server):
        self.server = server

    async def messages(self, body: MessagesRequest, request: Request) -> object:
        server = self.server
        model, name = await server.model(body.model)
        tools = body.offered_tools()
        ids = await model.chat_prompt(body.template_messages(), tools, "messages")
        tool_format = model.aengine.tool_format
        grammar, trigger = tools_grammar(tool_format, tools, body.forced_tools() is not None, body.parallel)
        in_reasoning = model.opens_reasoning(ids)
        try:
            params = model.after_reasoning(body.sampling_params(grammar, trigger, model.aengine.info.sampling_defaults),
                                           in_reasoning)
            await model.aengine.compile_grammar(params)
        except InvalidParamsError as exc:
            param = "tools" if exc.param == "grammar" else exc.param
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from exc
        gen = server.start(model, "msg", [ids], params, 1, None, body.stream)
        response = MessageResponse(gen, name, tool_format if tools else None, in_reasoning)
        if body.stream:
            return event_stream(response.events())
        await gen.wait(request)
        return await json_answer(response.body)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        model, _ = await self.server.model(body.model)
        ids = await model.chat_prompt(body.template_messages(), body.offered_tools(), "messages")
        return {"input_tokens": len(ids)}
