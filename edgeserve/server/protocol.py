"""The OpenAI wire format: request bodies (validated by pydantic) and the response and chunk shapes."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from edgeserve.sampling_params import SamplingParams
from edgeserve.text.tokenizer import Tokenizer

MAX_N = 64
MAX_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
_TOKEN_ID = re.compile(r"[0-9]+")  # ASCII only: str.isdigit also accepts "²" and other digits int() refuses


def _valid_unicode(value: str) -> str:
    # JSON escapes can spell lone surrogates ("\ud800"), which no tokenizer or UTF-8 encoder accepts.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate ({value[exc.start]!r}) at position {exc.start}, "
                         "which is not valid Unicode") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    # Strict: "0.5" is not a temperature and true is not a count, as with OpenAI. Unknown fields are
    # ignored, as vLLM and llama.cpp's server do, so clients that send vendor extras keep working.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Extensions that vLLM and llama.cpp's server also accept.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and not all(_TOKEN_ID.fullmatch(k) for k in value):
            raise ValueError("logit_bias keys must be token ids, written as strings of digits")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidParamsError (with the offending field) on values the engine refuses."""
        greedy = self.top_p == 0  # top_p 0 keeps only the most likely token
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else _or(self.temperature, 1.0),
            top_p=1.0 if greedy else _or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class ContentPart(_Body):
    type: Literal["text"]  # the model reads text only
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def as_template_message(self) -> dict[str, str]:
        """The {role, content} dict chat templates expect."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        # Templates know "system"; OpenAI's newer "developer" role means the same.
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return _or(self.top_logprobs, 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# responses ---------------------------------------------------------------------


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(response_id: str, object_: str, created: int, model: str, choices: list[dict],
             **extra: Any) -> dict:
    return {"id": response_id, "object": object_, "created": created, "model": model, "choices": choices, **extra}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def chat_logprobs(entries: list[dict], tokenizer: Tokenizer) -> dict:
    """The engine's per-token logprobs in the chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], tokenizer: Tokenizer, offset: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, logprobs, top alternatives, text offsets.

    `offset` is where the first token starts in the completion text.
    """
    tokens, offsets = [], []
    for e in entries:
        text = tokenizer.decode([e["token"]])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top"]} for e in entries],
        "text_offset": offsets,
    }
