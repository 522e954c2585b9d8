"""Ollama's request bodies, validated by pydantic, and the sampling parameters they ask for: its `options` (as
Modelfile parameters name them), `format` ("json" or a JSON Schema), `keep_alive` (how long the model stays
loaded once idle)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict

from edgeserve.sampling_params import MAX_STOP_STRINGS, InvalidParamsError, SamplingDefaults, SamplingParams
from edgeserve.server.models import parse_keep_alive
from edgeserve.server.openai.protocol import MAX_MESSAGES, at_most

# Ollama's num_predict: -1 generates until the model stops or the context is full, as does -2.
UNTIL_DONE = (-1, -2)


class Options(BaseModel):
    """The options that change an answer; others Ollama takes (num_ctx, num_thread, ...) are set per server."""

    model_config = ConfigDict(extra="ignore")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: Annotated[list[str], at_most(MAX_STOP_STRINGS)] | None = None


class KeepAlive(BaseModel):
    """A body's `keep_alive`: seconds or a duration ("5m"), negative for ever, 0 to unload once answered."""

    keep_alive: str | int | float | None = None

    def keep_alive_seconds(self) -> float | None:
        """The keep-alive in seconds, None where the body gives none; InvalidParamsError where it is no duration."""
        if self.keep_alive is None:
            return None
        try:
            return parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise InvalidParamsError(str(exc), "keep_alive") from None


class Body(KeepAlive):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = True
    options: Options = Options()
    format: Literal["json"] | dict[str, Any] | None = None

    def sampling_params(self, defaults: SamplingDefaults, context: int) -> SamplingParams:
        """The engine's parameters: the options over the model's defaults, `format` as the answer's grammar."""
        o = self.options
        sampling = defaults.apply({"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k,
                                   "min_p": o.min_p, "repetition_penalty": o.repeat_penalty,
                                   "repeat_last_n": o.repeat_last_n, "presence_penalty": o.presence_penalty,
                                   "frequency_penalty": o.frequency_penalty})
        limit = o.num_predict
        max_tokens = context if limit is None or limit in UNTIL_DONE else limit
        schema = {"type": "object"} if self.format == "json" else self.format
        return SamplingParams(max_tokens=max_tokens, **sampling, seed=o.seed, stop=list(o.stop or []),
                              json_schema=schema)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: ToolCallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    images: list[str] | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The dict chat templates expect, with Hugging Face's shape of tool calls."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": c.function.model_dump()} for c in self.tool_calls]
        return message


class ChatRequest(Body):
    messages: Annotated[list[Message], at_most(MAX_MESSAGES)] = []  # none: only load (or unload) the model
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Body):
    prompt: str = ""  # empty: only load the model (or unload it, with keep_alive 0)
    system: str | None = None
    raw: bool = False  # the prompt as is, without the chat template


class EmbedRequest(KeepAlive):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str]


class EmbeddingsRequest(KeepAlive):
    """The older /api/embeddings: one prompt."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = True
