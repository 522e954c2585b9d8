"""One chat conversation: its history, system prompt and sampling settings, the slash commands that
change them, saving and loading, and trimming the oldest turns to fit a context.

The terminal chat and every TUI session hold one each; nothing here knows about engines or screens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.sampling_params import SamplingParams

ROLES = ("system", "user", "assistant")

# The sampling settings `/set` may change, with the type each value is parsed as.
SETTINGS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "repeat_last_n": int,
    "max_tokens": int,
    "seed": int,
}

EXITS = ("/exit", "/bye", "/quit")
COMMANDS: list[tuple[str, str]] = [
    ("/help", "this help"),
    ("/reset", "forget the conversation (the system prompt and settings stay)"),
    ("/system [TEXT]", "set the system prompt (without TEXT: show it)"),
    ("/set [NAME VALUE]", f"change a sampling setting ({', '.join(SETTINGS)}); without NAME: list them"),
    ("/save FILE", "save the conversation as JSON"),
    ("/load FILE", "load a conversation saved with /save (or a JSON list of messages)"),
    ("/stats", "engine and conversation statistics"),
    ("/exit, /bye, /quit", "leave"),
]


class ConversationFileError(EdgeserveError):
    """A conversation file cannot be read, written or understood."""


class CommandError(EdgeserveError):
    """A slash command that cannot run: unknown, used wrongly, or not while an answer streams."""


@dataclass
class CommandOutcome:
    """What a slash command did: a line to show, and an action left to the front end."""

    message: str = ""
    action: str | None = None  # "help", "stats", "exit", or "history" (it changed: redraw it)


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages, oldest first
    settings: dict[str, float | int] = field(default_factory=dict)  # SamplingParams fields

    def __post_init__(self) -> None:
        self.sampling_params()  # reject bad settings at once

    def messages(self) -> list[dict]:
        """The whole history as chat messages, system prompt first."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.turns]

    def add(self, role: str, content: str) -> None:
        if role not in ("user", "assistant"):
            raise ValueError(f"turns are user or assistant messages, not {role!r}")
        self.turns.append({"role": role, "content": content})

    def pop_user(self) -> str:
        """Take back the last user message (one the model never answered)."""
        if not self.turns or self.turns[-1]["role"] != "user":
            raise ValueError("the last turn is not a user message")
        return self.turns.pop()["content"]

    def reset(self) -> None:
        self.turns.clear()

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.settings)

    def set(self, name: str, value: str) -> None:
        """Change one sampling setting from its text form; invalid values leave the settings as they were."""
        if name not in SETTINGS:
            raise CommandError(f"unknown setting {name!r} (choose from {', '.join(SETTINGS)})")
        try:
            parsed = SETTINGS[name](value)
        except ValueError:
            raise CommandError(f"{name} must be a number, got {value!r}") from None
        SamplingParams(**{**self.settings, name: parsed})
        self.settings[name] = parsed

    def trim(self, count_tokens: Callable[[list[dict]], int], budget: int) -> int:
        """Drop the oldest turns until the messages take at most `budget` tokens; return how many went.

        Whole exchanges go (a user message and the replies after it); the system prompt and the
        latest user message always stay, and PromptTooLongError says when even they do not fit.
        """
        dropped = 0
        while (n := count_tokens(self.messages())) > budget:
            if len(self.turns) <= 1:
                raise PromptTooLongError(
                    f"the message takes {n} tokens with the system prompt, but only {budget} fit "
                    f"(the context less room for the answer)")
            self.turns.pop(0)
            dropped += 1
            while len(self.turns) > 1 and self.turns[0]["role"] != "user":
                self.turns.pop(0)
                dropped += 1
        return dropped

    # files --------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        data = {"messages": self.messages(), "settings": self.settings}
        try:
            Path(path).expanduser().write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ConversationFileError(f"cannot write {path}: {exc.strerror}") from None

    @classmethod
    def load(cls, path: str | Path) -> Conversation:
        """Read a file written by save(), or a plain JSON list of {role, content} messages."""
        try:
            data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConversationFileError(f"cannot read {path}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConversationFileError(f"{path} is not JSON: {exc}") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        settings = data.get("settings", {}) if isinstance(data, dict) else {}
        if not isinstance(messages, list):
            raise ConversationFileError(f"{path} holds no list of messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise ConversationFileError(
                    f"{path}: message {i} must be an object with a role ({', '.join(ROLES)}) and a content string")
        if not isinstance(settings, dict) or set(settings) - set(SETTINGS):
            raise ConversationFileError(f"{path}: settings must be an object with keys among {', '.join(SETTINGS)}")
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
        turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
        try:
            return cls(system, turns, dict(settings))
        except EdgeserveError as exc:
            raise ConversationFileError(f"{path}: {exc}") from None

    # slash commands -------------------------------------------------------------

    def command(self, line: str, answering: bool = False) -> CommandOutcome:
        """Run one slash command line such as '/system Be brief.'; front ends handle the returned action.

        While an answer streams (answering), the history must stay as it is, for the answer to join it.
        """
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if answering and name in ("/reset", "/load"):
            raise CommandError(f"{name} must wait until the answer ends (Esc stops it)")
        if name in ("/help", "/stats"):
            return CommandOutcome(action=name[1:])
        if name in EXITS:
            return CommandOutcome(action="exit")
        if name == "/reset":
            self.reset()
            return CommandOutcome("conversation cleared", "history")
        if name == "/system":
            if not arg:
                return CommandOutcome(f"system prompt: {self.system}" if self.system else "no system prompt")
            self.system = arg
            return CommandOutcome("system prompt set")
        if name == "/set":
            if not arg:
                current = self.sampling_params()
                return CommandOutcome(", ".join(f"{k}={getattr(current, k)}" for k in SETTINGS))
            key, _, value = arg.partition(" ")
            if not value.strip():
                raise CommandError("usage: /set NAME VALUE")
            self.set(key, value.strip())
            return CommandOutcome(f"{key} = {self.settings[key]}")
        if name in ("/save", "/load"):
            if not arg:
                raise CommandError(f"usage: {name} FILE")
            if name == "/save":
                self.save(arg)
                return CommandOutcome(f"saved {len(self.turns)} messages to {arg}")
            loaded = Conversation.load(arg)
            self.system, self.turns = loaded.system, loaded.turns
            self.settings.update(loaded.settings)
            return CommandOutcome(f"loaded {len(self.turns)} messages from {arg}", "history")
        raise CommandError(f"unknown command {name} (/help lists them)")
