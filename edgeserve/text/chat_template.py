"""Rendering a conversation into a prompt with the model's Jinja chat template.

The environment follows Hugging Face transformers' `apply_chat_template`, because that is the
environment model authors write and test their templates against.
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeserve.errors import EdgeserveError
from edgeserve.text.tokenizer import Tokenizer
from edgeserve.text.tool_calls import ToolCallFormat, fallback_messages, format_for_template

# For models that ship no template: ChatML, which is what transformers used to fall back to.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A template is the model file's code: its rendering is bounded in time and in the size of what it builds, so a
# hostile or broken one (10^10 loop turns, a string doubled in a loop) fails one request instead of the process.
MAX_RENDER_SECONDS = 5.0
MAX_RENDER_CHARS = 1 << 23
_deadline: ContextVar[float] = ContextVar("template_deadline", default=float("inf"))


class ChatTemplateError(EdgeserveError):
    """A chat template failed to compile or render, or the messages given to it are malformed."""


def _check_clock() -> None:
    if time.monotonic() > _deadline.get():
        raise ChatTemplateError(f"the chat template took over {MAX_RENDER_SECONDS:g}s to render")


def _check_size(value: Any) -> None:
    if isinstance(value, (str, list)) and len(value) > MAX_RENDER_CHARS:
        raise ChatTemplateError(f"the chat template built a value of over {MAX_RENDER_CHARS} characters")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox whose calls, attribute reads, products and loops over range watch the clock and the
    size of what they make."""

    intercepted_binops = frozenset({"*"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, (str, list)) and isinstance(count, int) and len(sequence) * count > MAX_RENDER_CHARS:
            raise ChatTemplateError(f"the chat template built a value of over {MAX_RENDER_CHARS} characters")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # Jinja's signature
        _check_clock()
        for arg in args:
            _check_size(arg)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        value = super().getattr(obj, attribute)
        _check_size(value)
        return value


def _range(*args: int) -> Any:
    numbers = range(*args)
    if len(numbers) > MAX_RENDER_CHARS:
        raise ChatTemplateError(f"the chat template asked for a range of {len(numbers)} numbers")
    for n in numbers:
        _check_clock()
        yield n


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks in
    transformers; rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.Environment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.globals["range"] = _range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; `source` None means the ChatML fallback.

    Tools reach a template that reads a `tools` variable as that variable (Hugging Face's
    convention); other templates get them, and tool calls and results in the history, as text
    (`tool_calls.fallback_messages`). `tool_format` is how the model writes calls.
    """

    def __init__(
        self,
        source: str | None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        tool_format: ToolCallFormat | None = None,
    ) -> None:
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tool_format = tool_format or format_for_template(self.source)
        env = _environment()
        try:
            self._template = env.from_string(self.source)
            self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.source))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template does not compile: line {exc.lineno}: {exc.message}"
            ) from exc

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The model's own template (or ChatML when it ships none) with its BOS/EOS texts."""
        tool_format = format_for_template(tokenizer.chat_template or "", tokenizer.token_to_id)
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tool_format)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt for `messages` offering `tools` (OpenAI's {"type": "function", ...} entries);
        `extra` reaches the template as variables."""
        _check_messages(messages)
        if self.supports_tools:
            extra["tools"] = tools or None
        elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = fallback_messages(messages, tools, self.tool_format)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        token = _deadline.set(time.monotonic() + MAX_RENDER_SECONDS)
        try:
            parts, size = [], 0
            for part in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            ):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise ChatTemplateError(f"the chat template wrote over {MAX_RENDER_CHARS} characters")
                parts.append(part)
            return "".join(parts)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is the model author's code: any failure is theirs
            raise ChatTemplateError(
                f"chat template failed to render: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            _deadline.reset(token)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(
                f"messages[{index}] must be an object, got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}] needs a 'role' string")
        if not isinstance(message.get("content"), str):
            raise ChatTemplateError(f"messages[{index}] ({role}) needs a 'content' string")
