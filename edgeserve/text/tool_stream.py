"""A model's answer as events, read as it is written: text, reasoning, and tool calls with their arguments in pieces.

One state machine for every API: `AnswerEvents.feed` takes the next text and returns the events it settles;
`finish` ends the answer. A tool call (in the formats of `tool_calls`) is announced with its id and name as soon
as its name is written (`CallStarted`), its arguments follow as the model writes them (`CallArguments`), and
`CallEnded` closes it. A reasoning section (`<think>…</think>` at the start of the answer, or an answer whose
prompt opened one) comes as `ReasoningText`. Markup never reaches `Text`: a call the answer leaves unfinished
is dropped, or ended incomplete where it had been announced.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from edgeserve.text.tool_calls import (
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ToolCall,
    ToolCallFormat,
    call_from,
    new_call_id,
    partial_tag,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_DECODER = json.JSONDecoder()
# A call object's start, once its name is written and its arguments begin: `{"name": "f", "arguments": `.
_CALL_OPENING = '{"name"'
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnded:
    index: int
    complete: bool  # False: the answer ended (its length) inside the arguments


Event = Text | ReasoningText | CallStarted | CallArguments | CallEnded


class _JsonDepth:
    """Where a JSON value that opened with a bracket closes, read piece by piece."""

    def __init__(self, depth: int = 0):
        self.depth, self.in_string, self.escaped = depth, False, False

    def close(self, text: str) -> int:
        """The index just past the bracket in text that closes the value; -1 while it stays open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1




class AnswerEvents:
    """Reads one answer incrementally and turns it into events.

    fmt: the model's tool-call format where the request offered tools, else None (no calls are read).
    reasoning: read a leading `<think>` section as reasoning (False keeps it in the text).
    in_reasoning: the prompt opened the reasoning section, so the answer starts inside it.
    """

    def __init__(self, fmt: ToolCallFormat | None, reasoning: bool = True, in_reasoning: bool = False):
        self.fmt = fmt
        self.reasoning = reasoning
        self.buffer = ""  # text received and not yet settled into events
        self.mode = "reasoning" if reasoning and in_reasoning else "start"  # where the unread text stands
        self.calls: list[ToolCall] = []  # the complete calls so far
        self.call_ids: list[str] = []  # their ids, as announced
        self.texts: list[str] = []  # the text sent so far
        self.reasoning_texts: list[str] = []
        self._opened = 0  # calls announced
        self._marked = False  # the current call followed its format's marker (so it is markup, whatever follows)
        self._in_list = False  # inside Mistral's [ ... ] of calls
        self._depth: _JsonDepth | None = None
        self._name = self._id = ""
        self._pieces: list[str] = []  # the current call's arguments so far
        self._ended = False
        self._cut = False  # the answer ended at its length limit
        self._reasoned = False  # a reasoning section has ended

    # the answer's parts, for bodies ---------------------------------------------

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_texts)

    def feed(self, delta: str) -> list[Event]:
        """The events the answer's next text settles."""
        self.buffer += delta
        return self._run(final=False)

    def finish(self, cut: bool = False) -> list[Event]:
        """The answer has ended: the events of what was held back, and a call cut short ended incomplete.

        cut: it ended at its length limit, so a marker's beginning at its end is dropped, not text.
        """
        if self._ended:
            return []
        self._cut = cut
        if cut and self.mode == "text" and self.fmt is not None:
            marker = self.fmt.held_back(self.buffer)
            if marker:
                self.buffer = self.buffer[: len(self.buffer) - marker].rstrip()
        events = self._run(final=True)
        if self.mode == "arguments":
            events.append(CallEnded(self._opened - 1, complete=False))
        elif self.mode == "close":  # only the call object's closing bracket is missing: its arguments are whole
            self._end_call(events)
        self._ended = True
        self.buffer = ""
        return events

    # the machine ------------------------------------------------------------------

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self.mode}")(final, events)  # each mode is a method of its name
            if not step:
                return events

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if self._opened or self.calls:  # after calls, the whitespace between them is no text
            text = text if self.texts else text.lstrip()
        if text:
            self.texts.append(text)
            if events and isinstance(events[-1], Text):
                events[-1] = Text(events[-1].text + text)
            else:
                events.append(Text(text))

    def _start(self, final: bool, events: list[Event]) -> bool:  # nothing but whitespace yet
        stripped = self.buffer.lstrip()
        if self._reasoned:  # the answer after a reasoning section starts at its first word
            self.buffer = stripped
            if not stripped and not final:
                return False
        if self.reasoning and stripped.startswith(THINK_OPEN):
            self.buffer = stripped[len(THINK_OPEN):]
            self.mode = "reasoning"
            return True
        if self.reasoning and not final and THINK_OPEN.startswith(stripped):
            return False
        if self.fmt is not None and self._opens_without_marker(stripped, final):
            if stripped in ("", "["):
                return False  # too early to tell
            self.buffer = stripped
            self.mode = "object"
            return True
        self.mode = "text"
        return True

    def _opens_without_marker(self, stripped: str, final: bool) -> bool:
        """Whether an answer opening with stripped may be calls with their marker left out of the text.

        Tokenizers that hold the marker as a special token drop it from the text; Llama 3 may also omit it.
        """
        if isinstance(self.fmt, MistralFormat):
            return stripped.startswith("[{") or (not final and stripped in ("", "["))
        return stripped.startswith("{") or (not final and stripped == "")

    def _reasoning(self, final: bool, events: list[Event]) -> bool:
        end = self.buffer.find(THINK_CLOSE)
        if end >= 0:
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(THINK_CLOSE):].lstrip()
            self.mode = "start"
            self.reasoning = False  # one section, at the start
            self._reasoned = True
        else:
            keep = 0 if final else partial_tag(self.buffer, THINK_CLOSE)
            reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if reasoning:
            self.reasoning_texts.append(reasoning)
            events.append(ReasoningText(reasoning))
        return end >= 0

    def _text(self, final: bool, events: list[Event]) -> bool:
        fmt = self.fmt
        at = self.buffer.find(fmt.marker) if fmt is not None else -1
        if at >= 0:
            self._emit_text(self.buffer[:at].rstrip(), events)
            self.buffer = self.buffer[at + len(fmt.marker):]
            self._marked = True
            self.mode = "object"
            return True
        keep = 0
        if fmt is not None and not final:
            # What may begin the marker waits, and the whitespace before it, which a call would not keep.
            marker = fmt.held_back(self.buffer)
            keep = len(self.buffer) - len(self.buffer[: len(self.buffer) - marker].rstrip())
        self._emit_text(self.buffer[: len(self.buffer) - keep], events)
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _object(self, final: bool, events: list[Event]) -> bool:  # a call object is due
        rest = self.buffer.lstrip()
        if isinstance(self.fmt, MistralFormat) and not self._in_list and rest.startswith("["):
            self._in_list = True
            rest = rest[1:].lstrip()
        if not rest:
            self.buffer = ""
            return False
        if rest.startswith("{"):
            self.buffer = rest
            self.mode = "header"
            return True
        return self._to_text(rest)  # not a call after all: what follows the marker is text

    def _to_text(self, rest: str) -> bool:
        """Go on reading rest as text."""
        self.buffer = rest
        self._marked = False
        self.mode = "text"
        return True

    def _header(self, final: bool, events: list[Event]) -> bool:  # a call object, its name not yet known
        header = _HEADER.match(self.buffer)
        if header is not None and self.buffer[header.end():header.end() + 1] in ("{", "["):
            self._start_call(json.loads(header.group(1)), events)
            self.buffer = self.buffer[header.end():]
            self._depth = _JsonDepth()
            self.mode = "arguments"
            return True
        try:
            obj, end = _DECODER.raw_decode(self.buffer)
        except ValueError:
            if not final:
                return False
            # Ended before its name: a marked call, or one cut short as it began, is dropped; other text stays.
            opening = re.sub(r"\s", "", self.buffer)[: len(_CALL_OPENING)]
            if not self._marked and not (self._cut and _CALL_OPENING.startswith(opening)):
                self._emit_text(self.buffer, events)
            self.buffer = ""
            return False
        call = call_from(obj, self.fmt.args_key)
        if call is None:
            self._emit_text(self.buffer[:end], events)
        else:
            self._start_call(call.name, events)
            events.append(CallArguments(self._opened - 1, call.arguments))
            self._pieces = [call.arguments]
            self._end_call(events)
        self.buffer = self.buffer[end:]
        self.mode = "after" if call is not None else "text"
        return True

    def _start_call(self, name: str, events: list[Event]) -> None:
        self._name, self._pieces, self._id = name, [], new_call_id()
        events.append(CallStarted(self._opened, self._id, name))
        self._opened += 1

    def _end_call(self, events: list[Event]) -> None:
        self.calls.append(ToolCall(self._name, "".join(self._pieces)))
        self.call_ids.append(self._id)
        events.append(CallEnded(self._opened - 1, complete=True))

    def _arguments(self, final: bool, events: list[Event]) -> bool:  # streaming them
        end = self._depth.close(self.buffer)
        piece = self.buffer if end < 0 else self.buffer[:end]
        if piece:
            self._pieces.append(piece)
            events.append(CallArguments(self._opened - 1, piece))
        if end < 0:
            self.buffer = ""
            return False
        self.buffer = self.buffer[end:]
        self._depth = _JsonDepth(depth=1)  # inside the call object, which may hold more keys
        self.mode = "close"
        return True

    def _close(self, final: bool, events: list[Event]) -> bool:  # the rest of the call object
        end = self._depth.close(self.buffer)
        if end < 0:
            self.buffer = ""
            return False
        self.buffer = self.buffer[end:]
        self._end_call(events)
        self.mode = "after"
        return True

    def _after(self, final: bool, events: list[Event]) -> bool:  # a call has ended
        rest = self.buffer.lstrip()
        fmt = self.fmt
        if (not self._marked and not self._in_list) or isinstance(fmt, Llama3Format):
            # Unmarked calls (and Llama 3's) follow one another, separated by whitespace or "; ".
            rest = rest.lstrip(";").lstrip()
            if not rest and not final:
                self.buffer = ""
                return False
            if rest.startswith("{"):
                self.buffer = rest
                self.mode = "object"
                return True
        if isinstance(fmt, HermesFormat) and self._marked:
            closing = "</tool_call>"
            if rest.startswith(closing):
                rest = rest[len(closing):]
            elif not final and closing.startswith(rest):
                self.buffer = rest
                return False
        elif isinstance(fmt, MistralFormat) and self._in_list:
            if rest.startswith(","):
                self.buffer = rest[1:]
                self.mode = "object"
                return True
            if rest.startswith("]"):
                rest = rest[1:]
                self._in_list = False
            elif not rest and not final:
                self.buffer = ""
                return False
        return self._to_text(rest)


def read_answer(text: str, fmt: ToolCallFormat | None, reasoning: bool = True, in_reasoning: bool = False,
                cut: bool = False) -> AnswerEvents:
    """A whole answer read at once: its `text`, `reasoning_text` and complete `calls` (cut: as `finish`)."""
    answer = AnswerEvents(fmt, reasoning, in_reasoning)
    answer.feed(text)
    answer.finish(cut)
    return answer


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in prompt_tail opened a reasoning section (templates that start the answer's)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)
