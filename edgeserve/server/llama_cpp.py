"""llama.cpp server's own routes that tools call beside the OpenAI API: POST /tokenize and /detokenize, in its
shapes (`content`, `add_special`, `with_pieces`; `tokens`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from edgeserve.server.errors import APIError
from edgeserve.server.json_body import JsonBodyRoute

if TYPE_CHECKING:
    from edgeserve.server.app import Server


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    content: str
    model: str | None = None
    add_special: bool = False  # BOS where the model takes one, as llama.cpp's flag
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def router(server: Server) -> APIRouter:
    """The routes, on the tokenizer of the model a body names (`model`, which llama.cpp's server has no use for),
    else the default model's."""
    routes = APIRouter(route_class=JsonBodyRoute)

    async def tokenize(body: TokenizeRequest) -> dict:
        model, _ = await server.model(body.model)
        model.check_text_length(len(body.content), "content")
        ids = await model.aengine.tokenize(body.content, add_special=body.add_special)
        if not body.with_pieces:
            return {"tokens": ids}
        tokenizer = model.aengine.tokenizer
        return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}

    async def detokenize(body: DetokenizeRequest) -> dict:
        model, _ = await server.model(body.model)
        tokenizer = model.aengine.tokenizer
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens holds ids outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                           param="tokens", code="invalid_value")
        return {"content": tokenizer.decode(body.tokens)}

    routes.add_api_route("/tokenize", tokenize, methods=["POST"], response_model=None)
    routes.add_api_route("/detokenize", detokenize, methods=["POST"], response_model=None)
    return routes
