"""The Textual app of `edgeserve tui`: chat sessions side by side, all streaming through one chat client."""

from __future__ import annotations

import asyncio
import itertools

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Input, Static
from textual.worker import Worker

from edgeserve.cli.chat_clients import ChatClient, ReplyChunk, ReplyStats
from edgeserve.cli.chat_turn import Turn
from edgeserve.cli.tui_panels import StatusPanel
from edgeserve.cli.conversation import COMMANDS, Conversation
from edgeserve.errors import EdgeserveError

SESSION_COLOURS = ["#e06c75", "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2", "#d19a66", "#be5046"]
MAX_COLUMNS = 3  # more sessions than this wrap onto another row
KEYS = [
    ("Ctrl+N", "open a new session"),
    ("Ctrl+W", "close the current session (stops its answer)"),
    ("Esc", "stop the current session's answer"),
    ("Tab / Shift+Tab", "next / previous session"),
    ("Enter", "send the message"),
    ("F1 or ?", "this help"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 84; height: auto; border: round $primary; padding: 1 2; background: $surface; }
    """
    BINDINGS = [Binding("escape,f1,q,question_mark", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        text = Text()
        text.append("Keys\n", "bold")
        for key, what in KEYS:
            text.append(f"  {key:<18}", "bold")
            text.append(f"{what}\n")
        text.append("\nCommands (type them in a session)\n", "bold")
        for usage, what in COMMANDS:
            text.append(f"  {usage:<18}", "bold")
            text.append(f"{what}\n")
        text.append("\nEach session keeps its own history, system prompt and settings (/set temperature 0.2).\n"
                    "The KV map shows each pool block: the colour of the session holding it, shared blocks\n"
                    "(a prefix two sequences have in common), blocks cached for reuse, and free blocks.\n"
                    "Esc closes this help.", "dim")
        yield Static(text)


class SessionPane(Vertical):
    """One conversation: its transcript, its input line, and the answer it is streaming, if any."""

    DEFAULT_CSS = """
    SessionPane { border: round $panel; }
    SessionPane:focus-within { border: round $accent; }
    SessionPane > .transcript { height: 1fr; }
    SessionPane > .transcript > Static { margin-bottom: 1; }
    SessionPane > .transcript > .user { text-style: bold; }
    SessionPane > .transcript > .note { color: $text-muted; }
    SessionPane > .transcript > .error { color: $error; }
    """
    _request_numbers = itertools.count(1)

    def __init__(self, number: int, colour: str, conversation: Conversation):
        super().__init__(id=f"session-{number}")
        self.number = number
        self.colour = colour
        self.conversation = conversation
        self.request_id: str | None = None  # of the answer now streaming
        self.worker: Worker | None = None
        self.streamed_tokens = 0
        self.last_stats: ReplyStats | None = None

    @property
    def title(self) -> str:
        return f"Session {self.number}"

    @property
    def answering(self) -> bool:
        return self.worker is not None and not self.worker.is_finished

    def compose(self) -> ComposeResult:
        transcript = VerticalScroll(classes="transcript")
        transcript.can_focus = False  # Tab moves between the sessions' inputs
        yield transcript
        yield Input(placeholder="Message, or /help")

    def on_mount(self) -> None:
        self.styles.border_title_color = self.colour
        self.update_title()

    def update_title(self) -> None:
        params = self.conversation.sampling_params()
        state = "idle"
        if self.answering:
            state = f"answering · {self.streamed_tokens} tokens"
        elif self.last_stats is not None:
            state = self.last_stats.summary()
        self.border_title = f"● {self.title} · t={params.temperature:g}"
        self.border_subtitle = state

    def add_line(self, text: str, kind: str) -> Static:
        """Append to the transcript; kind is a message role, "note" or "error"."""
        line = Static(Text(text), classes=kind)
        if kind == "assistant":
            line.styles.color = self.colour
        transcript = self.query_one(".transcript", VerticalScroll)
        transcript.mount(line)
        transcript.scroll_end(animate=False)
        return line

    def redraw(self, note: str) -> None:
        """Show the conversation afresh (after /reset or /load), then note."""
        self.query_one(".transcript", VerticalScroll).remove_children()
        for message in self.conversation.turns:
            self.add_line(message["content"], message["role"])
        self.add_line(note, "note")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        event.input.value = ""
        if text.startswith("/"):
            self.run_command(text)
        elif text:
            self.send(text)

    def run_command(self, line: str) -> None:
        try:
            outcome = self.conversation.command(line, answering=self.answering)
        except EdgeserveError as exc:
            self.add_line(str(exc), "error")
            return
        if outcome.action == "history":
            self.redraw(outcome.message)
        elif outcome.message:
            self.add_line(outcome.message, "note")
        if outcome.action == "help":
            self.app.action_help()
        elif outcome.action == "stats":
            last = f"; last answer: {self.last_stats.summary()}" if self.last_stats else ""
            self.add_line(f"{len(self.conversation.turns)} messages{last}", "note")
        elif outcome.action == "exit":
            self.app.close_session(self)
        self.update_title()

    def send(self, text: str) -> None:
        if self.answering:
            self.add_line("still answering; Esc stops the answer", "error")
            return
        self.add_line(text, "user")
        self.worker = self.run_worker(self._answer(text), exit_on_error=False)
        self.update_title()

    def stop(self) -> None:
        """Stop the answer now streaming; the client aborts the request and frees its KV blocks."""
        if self.worker is not None:
            self.worker.cancel()

    async def _answer(self, text: str) -> None:
        try:
            turn = Turn.begin(self.app.client, self.conversation, text)
        except EdgeserveError as exc:
            self.add_line(str(exc), "error")
            return
        if turn.dropped:
            self.add_line(f"the conversation outgrew the context: dropped the {turn.dropped} oldest messages", "note")
        reply = self.add_line("", "assistant")

        def show(chunk: ReplyChunk) -> None:
            self.streamed_tokens = chunk.output_tokens
            if chunk.text:
                reply.update(Text(turn.text))
                self.query_one(".transcript", VerticalScroll).scroll_end(animate=False)
                self.update_title()

        self.streamed_tokens = 0
        self.request_id = f"session{self.number}-{next(self._request_numbers)}"
        try:
            self.last_stats = await turn.answer(self.request_id, show) or self.last_stats
        except EdgeserveError as exc:
            self.add_line(str(exc), "error")
        except asyncio.CancelledError:
            if self.is_attached:
                self.add_line("[stopped]", "note")
            raise
        finally:
            self.request_id = None
            if self.is_attached:
                self.call_later(self.update_title)


class EdgeserveApp(App):
    """Several chat sessions side by side, all streaming at once through one client, and the engine's live state."""

    TITLE = "edgeserve"
    CSS = """
    #main { height: 1fr; }
    #sessions { layout: grid; grid-size: 1; grid-rows: 1fr; width: 1fr; }
    """
    BINDINGS = [
        # Ctrl+N reaches the app after the focused input has seen the keys typed before it; Ctrl+W
        # must jump that queue (priority), as the input would take it for "delete a word"
        Binding("ctrl+n", "new_session", "New session"),
        Binding("ctrl+w", "close_session", "Close session", priority=True),
        Binding("escape", "stop_answer", "Stop answer"),
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, client: ChatClient, system: str | None = None, settings: dict | None = None,
                 refresh_interval: float = 0.25):
        super().__init__()
        self.client = client
        self.system = system
        self.settings = dict(settings or {})
        Conversation(system, [], self.settings)  # reject bad settings before the screen opens
        self.refresh_interval = refresh_interval
        self.status_panel = StatusPanel(client.model_name, client.runs_on, self.colour_of, id="status")
        self.startup_error: str | None = None
        self._numbers = itertools.count(1)

    @property
    def sessions(self) -> list[SessionPane]:
        return list(self.query(SessionPane))

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield Container(id="sessions")
            yield self.status_panel
        yield Footer()

    async def on_mount(self) -> None:
        try:
            await self.client.start()
        except EdgeserveError as exc:
            self.startup_error = str(exc)
            self.exit(return_code=1)
            return
        self.sub_title = f"{self.client.model_name} on {self.client.runs_on}"
        self.status_panel.model = self.client.model_name
        await self.action_new_session()
        self.set_interval(self.refresh_interval, self.refresh_status)

    async def on_unmount(self) -> None:
        await self.client.aclose()

    def colour_of(self, request_id: str) -> str | None:
        """The colour of the session whose answer is request_id, if it is one of ours."""
        return next((s.colour for s in self.sessions if s.request_id == request_id), None)

    async def refresh_status(self) -> None:
        try:
            status = await self.client.status()
        except EdgeserveError:
            return
        self.status_panel.show(status)

    def current_session(self) -> SessionPane | None:
        focused = self.focused
        while focused is not None and not isinstance(focused, SessionPane):
            focused = focused.parent
        return focused if isinstance(focused, SessionPane) else None

    def _layout_sessions(self) -> None:
        self.query_one("#sessions").styles.grid_size_columns = max(1, min(len(self.sessions), MAX_COLUMNS))

    async def action_new_session(self) -> SessionPane:
        number = next(self._numbers)
        pane = SessionPane(number, SESSION_COLOURS[(number - 1) % len(SESSION_COLOURS)],
                           Conversation(self.system, [], dict(self.settings)))
        await self.query_one("#sessions").mount(pane)
        self._layout_sessions()
        pane.query_one(Input).focus()
        return pane

    def close_session(self, pane: SessionPane) -> None:
        pane.stop()
        sessions = self.sessions
        following = sessions[(sessions.index(pane) + 1) % len(sessions)] if len(sessions) > 1 else None
        pane.remove()
        self.call_after_refresh(self._layout_sessions)
        if following is not None:
            following.query_one(Input).focus()

    def action_close_session(self) -> None:
        pane = self.current_session()
        if pane is not None:
            self.close_session(pane)

    def action_stop_answer(self) -> None:
        pane = self.current_session()
        if pane is not None:
            pane.stop()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())
