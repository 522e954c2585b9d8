"""`edgeserve chat`: a terminal conversation with the model, streamed token by token."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid

import click
from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Console
from rich.markup import escape

from edgeserve.cli.chat_clients import ChatClient, EngineClient, ReplyChunk, ReplyStats, stats_report
from edgeserve.cli.chat_turn import Turn
from edgeserve.cli.feedback import PromptSpinner, stderr_console, stop_note
from edgeserve.cli.markdown_stream import MarkdownStream
from edgeserve.cli.options import build_engine, model_options, sampling_options
from edgeserve.config import EngineConfig
from edgeserve.cli.conversation import COMMANDS, Conversation
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import home

PROMPT = ">>> "
INPUT_HELP = [
    ("Enter", "send"),
    ("\\ at the end of a line, or Esc Enter", "new line (multi-line input)"),
    ("Up / Down, Ctrl-R", "input history, search"),
    ("Ctrl-C", "stop the answer (at the prompt: clear the line)"),
    ("Ctrl-D", "leave"),
]


def _input_keys() -> KeyBindings:
    """Enter sends, unless the line ends in a backslash; Esc Enter (Meta-Enter) always starts a new line."""
    keys = KeyBindings()

    @keys.add("enter")
    def _(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if buffer.document.text_before_cursor.endswith("\\"):
            buffer.delete_before_cursor(1)
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @keys.add("escape", "enter")
    def _(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return keys


def _prompt_session() -> PromptSession:
    try:
        home().mkdir(parents=True, exist_ok=True)
        history = FileHistory(str(home() / "chat_history"))
    except OSError:
        history = InMemoryHistory()
    return PromptSession(history=history, key_bindings=_input_keys(), prompt_continuation="... ")


class ChatRepl:
    """Read a line, run it as a slash command or send it with the whole history, stream the answer.

    Answers go to stdout (as Markdown on a terminal, unless plain); notes, /help and /stats go to stderr,
    so piped output carries the answers only.
    """

    def __init__(self, client: ChatClient, conversation: Conversation, markdown: bool = True):
        self.client = client
        self.conversation = conversation
        self.out = Console(highlight=False)
        self.console = stderr_console()
        self.markdown = markdown and self.out.is_terminal
        self.view: MarkdownStream | None = None  # the answer streaming as Markdown
        self.spinner: PromptSpinner | None = None
        self.last: ReplyStats | None = None
        # line editing needs a terminal; piped input is read line by line
        self.session = _prompt_session() if sys.stdin.isatty() else None

    def note(self, text: str) -> None:
        self.console.print(escape(text), style="dim")

    def error(self, text: str) -> None:
        self.console.print(f"error: {escape(text)}", style="red")

    async def _read(self) -> str:
        if self.session is not None:
            return await self.session.prompt_async(PROMPT)
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            raise EOFError
        return line.rstrip("\n")

    async def run(self) -> None:
        self.note(f"{self.client.model_name} on {self.client.runs_on}. /help lists the commands; Ctrl-D leaves.")
        while True:
            try:
                line = (await self._read()).strip()
            except KeyboardInterrupt:
                continue
            except EOFError:
                return
            if not line:
                continue
            if line.startswith("/"):
                if not await self.command(line):
                    return
            else:
                await self.answer(line)

    async def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        try:
            outcome = self.conversation.command(line)
        except EdgeserveError as exc:
            self.error(str(exc))
            return True
        if outcome.message:
            self.note(outcome.message)
        if outcome.action == "help":
            self.show_help()
        elif outcome.action == "stats":
            await self.show_stats()
        return outcome.action != "exit"

    def show_help(self) -> None:
        width = max(len(k) for k, _ in COMMANDS + INPUT_HELP)
        for key, text in COMMANDS + INPUT_HELP:
            self.console.print(f"  [bold]{escape(key.ljust(width))}[/bold]  {escape(text)}")

    async def show_stats(self) -> None:
        for line in await stats_report(self.client, self.conversation, self.last):
            self.console.print(escape(line))

    async def answer(self, text: str) -> None:
        try:
            turn = Turn.begin(self.client, self.conversation, text)
        except EdgeserveError as exc:
            self.error(str(exc))
            return
        if turn.dropped:
            self.note(f"the conversation outgrew the context: dropped the {turn.dropped} oldest messages "
                      f"(/reset starts afresh)")
        self.spinner = PromptSpinner(self.console, self.client.count_tokens(self.conversation.messages()))
        # the answer streams in a task of its own, so that Ctrl-C can cancel it and leave the REPL running
        task = asyncio.ensure_future(turn.answer(f"chat-{uuid.uuid4().hex[:12]}", self._print))
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            stats = await task
        except asyncio.CancelledError:
            self._end_answer()
            self.note("[interrupted]")
            return
        except EdgeserveError as exc:
            self._end_answer()
            self.error(str(exc))
            return
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        self._end_answer()
        if stats is not None:
            self.last = stats
            note = stats.summary()
            if (stop := stop_note(stats.finish_reason, stats.output_tokens, turn.params.max_tokens)) is not None:
                note += f" · {stop}"
            self.note(note)

    def _print(self, chunk: ReplyChunk) -> None:
        if not chunk.text:
            return
        self.spinner.stop()
        if not self.markdown:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            return
        if self.view is None:
            self.view = MarkdownStream(self.out)
        self.view.add(chunk.text)

    def _end_answer(self) -> None:
        """Stop the spinner, draw the whole answer, and end its line."""
        self.spinner.stop()
        if self.view is not None:
            self.view.end()
            self.view = None
        elif not self.markdown:
            sys.stdout.write("\n")
            sys.stdout.flush()


@click.command()
@model_options
@sampling_options(max_tokens=1024)
@click.option("--system", default=None, help="System prompt.")
@click.option("--plain", is_flag=True, help="Print answers as plain text, not rendered as Markdown.")
def chat(model: str, config: EngineConfig, settings: dict, system: str | None, plain: bool) -> None:
    """Talk with a model in the terminal; the answer streams as it is generated."""
    engine = build_engine(model, config)
    conversation = Conversation(system=system, settings=engine.model.sampling_defaults.apply(settings))
    from edgeserve.engine.async_engine import AsyncEngine  # imports the engine: after build_engine's note

    aengine = AsyncEngine(engine)
    try:
        asyncio.run(ChatRepl(EngineClient(aengine), conversation, markdown=not plain).run())
    finally:
        aengine.shutdown()
