"""llama.cpp server's own routes that tools call beside the OpenAI API: POST /tokenize and /detokenize, in its
shapes (`content`, `add_special`, `with_pieces`; `tokens`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from edgeserve.server.errors import APIError

if TYPE_CHECKING:
    from edgeserve.server.app import Server


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False  # BOS where the model takes one, as llama.cpp's flag
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int] = Field(max_length=1 << 20)


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s tokenizer."""
    aengine = server.aengine
    routes = APIRouter()

    async def tokenize(body: TokenizeRequest) -> dict:
        server.check_text_length(len(body.content), "content")
        ids = await aengine.tokenize(body.content, add_special=body.add_special)
        if not body.with_pieces:
            return {"tokens": ids}
        tokenizer = aengine.tokenizer
        return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}

    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = aengine.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens holds ids outside the vocabulary (0..{vocab - 1})", param="tokens",
                           code="invalid_value")
        return {"content": aengine.tokenizer.decode(body.tokens)}

    routes.add_api_route("/tokenize", tokenize, methods=["POST"], response_model=None)
    routes.add_api_route("/detokenize", detokenize, methods=["POST"], response_model=None)
    return routes
