"""Anthropic's request bodies (a message, counting its tokens), validated by pydantic, and what they ask the engine
for: template messages, the tools offered or forced, sampling parameters."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgeserve.sampling_params import GrammarTrigger, SamplingDefaults, SamplingParams
from edgeserve.server.openai.protocol import MAX_MESSAGES, Text, at_most, check_unique_names, offered


class _Body(BaseModel):
    # Strict as Anthropic's API is about types; unknown fields are ignored, so clients that send newer
    # fields (betas, context management) keep working.
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: Text = ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "user" and any(isinstance(b, (ToolUseBlock, ThinkingBlock)) for b in blocks):
            raise ValueError("tool_use and thinking blocks belong to assistant messages")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlock) for b in blocks):
            raise ValueError("tool_result blocks belong to user messages")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """This message as chat-template messages: tool results become tool messages, tool uses tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            if calls:
                message["tool_calls"] = calls
            return [message]
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
               for b in self.content if isinstance(b, ToolResultBlock)]
        if text or not out:
            out.append({"role": "user", "content": text})
        return out


class ToolDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates and tool-call grammars take it."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool_choice names its tool exactly when its type is 'tool'")
        return self


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class _Prompt(_Body):
    """What a message and a token count share: the conversation and the tools."""

    model: Text
    messages: Annotated[list[Message], at_most(MAX_MESSAGES)] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        check_unique_names([t.name for t in value or []])
        return value

    @model_validator(mode="after")
    def _choice_among_tools(self) -> _Prompt:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The system prompt and the messages, as chat templates take them."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for message in self.messages:
            out += message.template_messages()
        return out

    @property
    def choice(self) -> str:
        """"none", "auto", "any" or "tool" (auto where tools are given, as Anthropic's default)."""
        return self.tool_choice.type if self.tool_choice is not None else "auto"

    def offered_tools(self) -> list[dict] | None:
        """The tools the model sees, as {"type": "function", "function": {...}} dicts; None without or with none."""
        name = self.tool_choice.name if self.choice == "tool" else None
        return offered([t.openai() for t in self.tools or []], self.choice, name)

    def forced_tools(self) -> list[dict] | None:
        """The tools one of which the answer must use (tool_choice any or tool), else None."""
        return self.offered_tools() if self.choice in ("any", "tool") else None

    @property
    def parallel(self) -> bool:
        """Whether the answer may use several tools."""
        return self.choice != "tool" and not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)


class MessagesRequest(_Prompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("stop sequences must not be empty")
        return value

    def sampling_params(self, grammar: str | None, trigger: GrammarTrigger | None,
                        defaults: SamplingDefaults) -> SamplingParams:
        """The engine's parameters; grammar: the Lark grammar of the tool calls, bound once trigger fires where one
        is given."""
        sampling = defaults.apply({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k})
        return SamplingParams(max_tokens=self.max_tokens, **sampling, stop=list(self.stop_sequences or []),
                              grammar=grammar, grammar_trigger=trigger)


class CountTokensRequest(_Prompt):
    pass


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as a tool_use block's input, which must be an object.

    Arguments no grammar held may be no object, or no JSON: they are kept, under "arguments".
    """
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
