"""OpenAI's request bodies (chat and text completions, the Responses API), validated by pydantic, and what they ask
the engine for."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from edgeserve.sampling_params import MAX_STOP_STRINGS, GrammarTrigger, SamplingDefaults, SamplingParams
from edgeserve.server.errors import APIError

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

# Bodies are validated on the event loop, item by item: a list past these is refused before its items are looked at
# (120,000 messages would stall every stream for seconds). Far above any real conversation or stop list.
MAX_MESSAGES = 10_000


def at_most(limit: int) -> BeforeValidator:
    """A list field's check, run before its items are validated: at most `limit` of them."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"holds {len(value)} items; at most {limit} are accepted")
        return value

    return BeforeValidator(check)


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
    stop: Text | Annotated[list[Text], at_most(MAX_STOP_STRINGS)] | None = None
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
    # Constrained output, as vLLM names it: a JSON Schema, a regex, or a Lark grammar (llguidance's dialect).
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_grammar: Text | None = None
    # This request's speculative decoding (None: the server's --speculative).
    speculative: Literal["auto", "ngram", "draft", "off"] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and not all(_TOKEN_ID.fullmatch(k) for k in value):
            raise ValueError("logit_bias keys must be token ids, written as strings of digits")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> dict[str, Any]:
        """The grammar asked for, as SamplingParams fields; APIError when more than one is."""
        given = {name: value for name, value in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                                                  ("guided_grammar", self.guided_grammar)) if value is not None}
        if len(given) > 1:
            raise APIError(400, f"give at most one of {', '.join(given)}", param=list(given)[1], code="invalid_value")
        return {"json_schema": self.guided_json, "regex": self.guided_regex, "grammar": self.guided_grammar}

    def api_param(self, param: str | None) -> str | None:
        """The request field behind a SamplingParams field named in an error."""
        return {"json_schema": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar"}.get(param, param)

    def sampling_params(self, max_tokens: int, logprobs: int | None, grammar: str | None = None,
                        defaults: SamplingDefaults | None = None,
                        trigger: GrammarTrigger | None = None) -> SamplingParams:
        """Raises InvalidParamsError (with the offending field) on values the engine refuses.

        grammar: a Lark grammar the server adds (the tool calls' grammar, where the request offers tools), bound
        once trigger fires where one is given.
        defaults: the model's sampling defaults, for the fields the request leaves out.
        """
        greedy = self.top_p == 0  # top_p 0 keeps only the most likely token
        constraint = self.constraint()
        if grammar is not None:
            constraint["grammar"] = grammar
        sampling = (defaults or SamplingDefaults()).apply({
            "temperature": 0.0 if greedy else self.temperature, "top_p": 1.0 if greedy else self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
        })
        return SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            **constraint,
            grammar_trigger=trigger,
            speculative=self.speculative,
        )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class ContentPart(_Body):
    type: Text
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise PydanticCustomError("unsupported_content", "this model reads text only: a content part of type "
                                      "{kind} cannot be read", {"kind": repr(kind)})
        return kind


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text


class MessageToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The dict chat templates expect: role and content, and Hugging Face's shapes of tool calls and results."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        # Templates know "system"; OpenAI's newer "developer" role means the same.
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            # Templates write arguments with `| tojson`: they expect an object, not JSON text.
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name:
                message["name"] = self.name
        return message


def json_or_text(text: str) -> Any:
    """JSON text as its value (as templates take a call's arguments); text that is no JSON as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_unique_names(names: list[str]) -> None:
    """ValueError where two tools share a name."""
    if len(set(names)) < len(names):
        raise ValueError("tool names must be unique")


def offered(tools: list[dict], choice: str, name: str | None) -> list[dict] | None:
    """The tools (chat-shaped dicts) the model sees: none under tool_choice "none", only the one a choice names."""
    if not tools or choice == "none":
        return None
    return [t for t in tools if t["function"]["name"] == name] if name is not None else tools


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None  # arguments always follow the schema where a call is forced (tool_choice)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Text
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always strict: the output follows the schema


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema: {name, schema}")
        return self

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The schema the content must follow, None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None


# OpenAI fields we refuse rather than drop, and why (fields we accept and ignore are listed in the README).
UNSUPPORTED_CHAT_FIELDS = {
    "functions": "the legacy functions are not supported; send tools",
    "function_call": "the legacy function_call is not supported; send tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], at_most(MAX_MESSAGES)] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # As llama.cpp's server: a leading <think> section comes apart as reasoning_content, or with "none" stays in
    # the content as the model wrote it.
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"
    modalities: list[Literal["text"]] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator(*UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(UNSUPPORTED_CHAT_FIELDS[info.field_name])
        return value

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        check_unique_names([t.function.name for t in value or []])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = {t.function.name for t in info.data.get("tools") or []}
        if value is not None and value != "none" and not names:
            raise ValueError("a tool choice other than 'none' needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names {value.function.name!r}, which is not among the tools")
        return value

    @property
    def choice(self) -> str:
        """"none", "auto", "required" or "named" (OpenAI's default: auto with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def offered_tools(self) -> list[dict] | None:
        """The tools the model sees, as {"type": "function", "function": {...}} dicts; None with tool_choice none."""
        name = self.tool_choice.function.name if self.choice == "named" else None
        return offered([t.model_dump(exclude_none=True) for t in self.tools or []], self.choice, name)

    def forced_tools(self) -> list[dict] | None:
        """The tools one of which the answer must call (tool_choice required or named), else None."""
        return self.offered_tools() if self.choice in ("required", "named") else None

    def api_param(self, param: str | None) -> str | None:
        if param == "json_schema" and self.response_format is not None:
            return "response_format"
        if param == "grammar" and self.offered_tools() and self.guided_grammar is None:
            return "tools"
        return super().api_param(param)

    def constraint(self) -> dict[str, Any]:
        constraint = super().constraint()
        schema = self.response_format.output_schema if self.response_format is not None else None
        if schema is not None:
            if any(v is not None for v in constraint.values()):
                raise APIError(400, "give response_format or a guided_* field, not both", param="response_format",
                               code="invalid_value")
            if self.forced_tools():
                raise APIError(400, f"response_format cannot be combined with tool_choice {self.choice!r}: "
                                    "the answer must be a tool call", param="response_format", code="invalid_value")
            constraint["json_schema"] = schema
        elif self.forced_tools() and any(v is not None for v in constraint.values()):
            raise APIError(400, f"a guided_* field cannot be combined with tool_choice {self.choice!r}",
                           param="tool_choice", code="invalid_value")
        return constraint

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


class EmbeddingRequest(_Body):
    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return value

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("dimensions is not supported: embeddings have the model's hidden size")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The batch: each a string or a list of token ids."""
        i = self.input
        return [i] if isinstance(i, str) or isinstance(i[0], int) else list(i)


# The Responses API ---------------------------------------------------------------------------------------------


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]
    id: Text | None = None
    status: Text | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]
    id: Text | None = None
    status: Text | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Body):
    """A reasoning item sent back with the output it came with: past reasoning does not go into the prompt."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["reasoning"]


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


def _item_type(value: Any) -> Any:
    # A message may leave its type out ({"role": "user", "content": "..."}).
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


def template_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
                      ) -> list[dict[str, Any]]:
    """Responses items as chat-template messages: a run of function calls joins its assistant message as tool_calls,
    a call's output is a tool message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": json_or_text(item.arguments)}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool in the shape chat templates and tool-call grammars take."""
        return Tool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters)).model_dump(exclude_none=True)


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: Text


class TextFormat(_Body):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self

    @property
    def output_schema(self) -> dict[str, Any] | None:
        return {"type": "object"} if self.type == "json_object" else self.schema_


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], BeforeValidator(lambda v: [_item_type(x) for x in v]
                                                             if isinstance(v, list) else v)]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[FunctionTool] | None) -> list[FunctionTool] | None:
        check_unique_names([t.name for t in value or []])
        return value

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ResponsesRequest:
        names = {t.name for t in self.tools or []}
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("a tool_choice other than 'none' needs tools")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        if self.output_schema is not None and self.forced_tools():
            raise ValueError("text.format json_schema cannot be combined with a tool_choice that forces a call")
        return self

    @property
    def choice(self) -> str:
        """"none", "auto", "required" or "named"."""
        if isinstance(self.tool_choice, FunctionToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def offered_tools(self) -> list[dict] | None:
        """The tools the model sees, in the chat shape; None without tools or with tool_choice none."""
        name = self.tool_choice.name if self.choice == "named" else None
        return offered([t.chat_tool() for t in self.tools or []], self.choice, name)

    def forced_tools(self) -> list[dict] | None:
        return self.offered_tools() if self.choice in ("required", "named") else None

    @property
    def output_schema(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.output_schema if fmt is not None else None

    def input_items(self) -> list[Any]:
        """The input as items (a text input is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def sampling_params(self, max_tokens: int, grammar: str | None, trigger: GrammarTrigger | None,
                        defaults: SamplingDefaults) -> SamplingParams:
        """The engine's parameters; grammar: the Lark grammar of the tool calls, bound once trigger fires where one
        is given."""
        sampling = defaults.apply({"temperature": self.temperature, "top_p": self.top_p})
        return SamplingParams(max_tokens=max_tokens, **sampling, json_schema=self.output_schema, grammar=grammar,
                              grammar_trigger=trigger)
