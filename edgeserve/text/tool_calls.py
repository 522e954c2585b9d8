"""Tool calls in a model's own format: the grammar that forces them, reading a call object, and history as text.

Three formats, chosen from the chat template's source: Hermes/Qwen (`<tool_call>{json}</tool_call>`),
Mistral (`[TOOL_CALLS][{json}, ...]`) and Llama 3 (the message is `{"name": ..., "parameters": ...}`).
Templates without tool support get Hermes through a system prompt (`fallback_messages`). `tool_stream` reads
the calls out of an answer as it is written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edgeserve.sampling_params import JSON_OPTIONS, OPENING_BLANKS, GrammarTrigger, schema_text


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def openai(self, call_id: str | None = None, index: int | None = None) -> dict:
        """The OpenAI shape (`index` for a streamed delta)."""
        call = {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from(obj: Any, args_key: str) -> ToolCall | None:
    """The call a decoded JSON object describes ({"name": ..., args_key: {...}}), or None if it is none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _tool_schema(tool: dict, args_key: str) -> dict:
    """JSON Schema of one call of `tool` ({"type": "function", "function": {...}}) in a format."""
    function = tool["function"]
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           args_key: function.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text begin tag (so wait for more before deciding)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _class_char(ch: str) -> str:
    """ch inside a regex character class."""
    return "\\" + ch if ch in "\\[]^-&~" else ch


def not_containing(marker: str) -> str:
    """A regex (Rust's syntax) of the non-empty texts in which marker never occurs (they may end with its beginning).

    Built from the marker's matching automaton, for markers whose first character occurs only there: from "matched
    k characters", the next one goes on, back to one on the first character, else back to none.
    """
    first, rest = marker[0], marker[1:]
    assert first not in rest, f"{marker!r}: the first character must not recur"
    lit = re.escape
    # From "matched one", the ways back to it without completing the marker, and the ways out to "matched none".
    back = "|".join(lit(rest[:j]) + lit(first) for j in range(len(rest)))
    out = "|".join(lit(rest[:j]) + f"[^{_class_char(rest[j])}{_class_char(first)}]" for j in range(len(rest)))
    partial = "".join(f"({lit(ch)}" for ch in rest[:-1]) + ")?" * (len(rest) - 1)
    return f"([^{_class_char(first)}]|{lit(first)}({back})*({out}))*({lit(first)}({back})*{partial})?"


def _json_rule(schema: dict) -> str:
    """A Lark rule for JSON following schema, written as the engine writes JSON (JSON_OPTIONS)."""
    return f"%json {schema_text({**schema, 'x-guidance': JSON_OPTIONS})}"


class ToolCallFormat:
    """How a model family writes tool calls; `marker` opens them (optional for Llama 3, whose answer may be the call)."""

    name = ""
    marker = ""
    args_key = "arguments"

    def __init__(self, marker_token: int | None = None):
        # Mistral's and Llama 3's tokenizers hold the marker as one special token, which grammars name by id.
        self.marker_token = marker_token

    def call_schema(self, tools: list[dict]) -> dict:
        schemas = [_tool_schema(t, self.args_key) for t in tools]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    @property
    def marker_rule(self) -> str:
        """The marker in a Lark grammar."""
        return f"<[{self.marker_token}]>" if self.marker_token is not None else json.dumps(self.marker)

    def tail_rules(self, tools: list[dict], parallel: bool) -> str:
        """Lark rules (llguidance's dialect) whose `tail` is what follows the marker: one call of tools, or several if
        parallel."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call, or several if parallel, of tools."""
        return f"start: {self.marker_rule} tail\n{self.tail_rules(tools, parallel)}"

    def triggered_grammar(self, tools: list[dict], parallel: bool) -> tuple[str, GrammarTrigger]:
        """(grammar, trigger) for an answer that may call tools: the grammar binds once the answer writes the
        trigger (the marker), from the token where it begins: any text up to the marker, then calls that follow
        the tools' schemas."""
        if self.marker_token is not None:  # a special token, which no text spells: bound from it
            return self.grammar(tools, parallel), GrammarTrigger(token_id=self.marker_token)
        lead = f"({not_containing(self.marker)})?{re.escape(self.marker)}"
        return (f"start: lead tail\nlead[lazy]: /{lead}/\n{self.tail_rules(tools, parallel)}",
                GrammarTrigger(text=self.marker))

    def write(self, calls: list[ToolCall]) -> str:
        """Calls as the model would write them (for history in templates without tool support)."""
        raise NotImplementedError

    def held_back(self, content: str) -> int:
        """Characters at the end of streamed content that may begin the marker, so wait for the next text."""
        return partial_tag(content, self.marker)


class HermesFormat(ToolCallFormat):
    name = "hermes"
    marker = "<tool_call>"

    def tail_rules(self, tools: list[dict], parallel: bool) -> str:
        more = ' ("\\n<tool_call>" call)*' if parallel else ""
        return (f'tail: call{more}\ncall: "\\n" body "\\n</tool_call>"\n'
                f"body: {_json_rule(self.call_schema(tools))}\n")

    def write(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
                         for c in calls)


class MistralFormat(ToolCallFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def tail_rules(self, tools: list[dict], parallel: bool) -> str:
        array = {"type": "array", "items": self.call_schema(tools), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return f"tail: {_json_rule(array)}\n"

    def write(self, calls: list[ToolCall]) -> str:
        items = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"{self.marker}[{items}]"

    def held_back(self, content: str) -> int:
        if content.lstrip() in ("", "["):  # may open a call list
            return len(content)
        return super().held_back(content)


class Llama3Format(ToolCallFormat):
    name = "llama3"
    marker = "<|python_tag|>"
    args_key = "parameters"

    def tail_rules(self, tools: list[dict], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"tail: call{more}\ncall: {_json_rule(self.call_schema(tools))}\n"

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return f"start: tail\n{self.tail_rules(tools, parallel)}"  # the marker is optional: left out

    def triggered_grammar(self, tools: list[dict], parallel: bool) -> tuple[str, GrammarTrigger]:
        """The call is the whole message, opened by the marker's token or by its object's `{`: the grammar holds
        from the first token, and takes any other opening too (OTHER), at which the engine lets it go."""
        blank = "".join(f"\\x{ord(ch):02x}" for ch in OPENING_BLANKS)
        tagged = f"{self.marker_rule} GAP tail | " if self.marker_token is not None else ""
        return (f"start: GAP ({tagged}tail | OTHER)?\nGAP: /[{blank}]*/\nOTHER: /[^{{{blank}](?s:.)*/\n"
                f"{self.tail_rules(tools, parallel)}",
                GrammarTrigger(text="{", token_id=self.marker_token, opening=True))

    def write(self, calls: list[ToolCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def held_back(self, content: str) -> int:
        # Until the message shows something other than a call's start, any of it may be one.
        stripped = content.lstrip()
        if not stripped or self.marker.startswith(stripped[: len(self.marker)]):
            return len(content)
        return 0


def tools_grammar(fmt: ToolCallFormat, tools: list[dict] | None, forced: bool,
                  parallel: bool) -> tuple[str | None, GrammarTrigger | None]:
    """(grammar, trigger) of an answer offered tools: calls from the start where a call is forced, else calls that
    follow the tools' schemas once the trigger fires; (None, None) without tools."""
    if not tools:
        return None, None
    if forced:
        return fmt.grammar(tools, parallel), None
    return fmt.triggered_grammar(tools, parallel)


REASONING_END = "</think>"


def after_reasoning(kind: str, source: str) -> str | None:
    """A Lark grammar that lets a reasoning section the prompt opened run to its end, then binds the constraint
    (kind "json_schema" or "lark", as `SamplingParams.constraint`); None for a kind it cannot follow (a regex)."""
    if kind == "json_schema":
        answer = f"answer: {_json_rule(json.loads(source))}\n"
    elif kind == "lark":
        answer = re.sub(r"^start(\s*):", r"answer\1:", source, count=1, flags=re.MULTILINE)
    else:
        return None
    thought = f"({not_containing(REASONING_END)})?{re.escape(REASONING_END)}".replace("/", "\\/")
    return f"start: thought GAP answer\nthought[lazy]: /{thought}/\nGAP: /[ \\t\\n]*/\n{answer}"


def format_for_template(source: str, token_to_id: Any = None) -> ToolCallFormat:
    """The tool-call format a chat template's source writes; Hermes where it shows none.

    token_to_id (the tokenizer's) lets a format name its marker token in grammars.
    """
    if "[TOOL_CALLS]" in source:
        return MistralFormat(token_to_id("[TOOL_CALLS]") if token_to_id else None)
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source):
        return Llama3Format(token_to_id("<|python_tag|>") if token_to_id else None)
    return HermesFormat()


FALLBACK_TOOLS_PROMPT = (
    "You may call one or more functions to answer. The functions, as JSON Schema:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with its name and arguments as a JSON object inside tags:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def fallback_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolCallFormat) -> list[dict]:
    """Messages for a template that knows no tools: the tools in the system prompt, calls and results as text.

    Assistant calls become the format's text; a tool result becomes a user turn in <tool_response> tags.
    """
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            text = "\n".join(filter(None, [m.get("content") or "", fmt.write(calls)]))
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
