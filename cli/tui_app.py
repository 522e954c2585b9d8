"""The Textual app of `edgeserve tui`: chat sessions side by side, all streaming through one chat client."""

from __future__ import annotations

import asyncio
import itertools

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.reactive import reactive
from textual.containers import Container, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Input, Static
from textual.worker import Worker

from edgeserve.cli.chat_clients import ChatClient, ReplyChunk, ReplyStats, stats_report
from edgeserve.cli.chat_markdown import chat_markdown
from edgeserve.cli.chat_turn import Turn
from edgeserve.cli.feedback import prompt_note
from edgeserve.cli.tui_panels import StatusPanel, panel_width
from edgeserve.cli.conversation import COMMANDS, Conversation
from edgeserve.errors import EdgeserveError

SESSION_COLOURS = ["#e06c75", "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2", "#d19a66", "#be5046"]
MAX_COLUMNS = 3  # more sessions than this wrap onto another row
MIN_SESSION_WIDTH = 38  # columns a session needs to stay readable; fewer, and sessions wrap onto rows
WIDE = 120  # columns from which the engine panel shows beside the sessions, unless F2 says otherwise
NARROW_SESSION = 60  # below this width a session's border shows the short form of its answer's figures
KEYS = [
    ("Ctrl+N", "open a new session"),
    ("Ctrl+W", "close the current session (stops its answer)"),
    ("Esc", "stop the current session's answer"),
    ("Tab / Shift+Tab", "next / previous session"),
    ("Enter", "send the message"),
    ("F2", f"show or hide the engine panel (hidden by itself below {WIDE} columns)"),
    ("? or F1", "this help (? on an empty input line)"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 100%; height: auto; max-height: 100%;
                                  border: round $primary; background: $surface; }
    HelpScreen Static { padding: 0 1 1 1; }
    """
    BINDINGS = [Binding("escape,f1,q,question_mark", "app.pop_screen", "Close")]
    NOTE = ("Each session keeps its own history, system prompt and settings (/set temperature 0.2). The KV map "
            "shows each pool block (or, in a large pool, each few blocks: the legend says how many): the colour of "
            "the session holding it, shared blocks (a prefix two sequences have in common), blocks cached for "
            "reuse, and free blocks. Esc closes this help.")

    def compose(self) -> ComposeResult:
        yield VerticalScroll(Static(self.table("Keys", KEYS)),
                             Static(self.table("Commands (type them in a session)", COMMANDS)),
                             Static(Text(self.NOTE, "dim")))

    @staticmethod
    def table(title: str, rows: list[tuple[str, str]]) -> Table:
        """Two columns that wrap apart, however narrow the screen."""
        table = Table(title=title, title_style="bold", title_justify="left", box=None, show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key, what in rows:
            table.add_row(key, what)
        return table


class MessageInput(Input):
    """The input line of a session: `?` on an empty line opens the help rather than typing itself."""

    def check_consume_key(self, key: str, character: str | None) -> bool:
        if character == "?" and not self.value:
            return False  # the footer shows the app's `?` binding
        return super().check_consume_key(key, character)

    async def _on_key(self, event: events.Key) -> None:
        # decided here, in the order the keys were typed: an app binding sees a key before the input has
        # taken the keys typed just before it, and would find the line still empty. Otherwise Input's own
        # handler, which Textual calls after this one, types the key.
        if event.character == "?" and not self.value:
            event.stop()
            event.prevent_default()
            self.app.action_help()


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
    state = reactive("idle")  # what the session is doing, shown in its bottom border

    def __init__(self, number: int, colour: str, conversation: Conversation):
        super().__init__(id=f"session-{number}")
        self.number = number
        self.colour = colour
        self.conversation = conversation
        self.request_id: str | None = None  # of the answer now streaming
        self.worker: Worker | None = None
        self.streamed_tokens = 0
        self.prompt_tokens: int | None = None  # of the answer now streaming, where the client can count them
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
        yield MessageInput(placeholder="Message, /help, or ? for keys")

    def on_mount(self) -> None:
        self.styles.border_title_color = self.colour
        self.update_title()

    def update_title(self) -> None:
        params = self.conversation.sampling_params()
        state = "idle"
        if self.answering:
            state = f"answering · {self.streamed_tokens} tokens" if self.streamed_tokens else prompt_note(self.prompt_tokens)
        elif self.last_stats is not None:
            state = self.last_stats.summary() if self.size.width >= NARROW_SESSION else self.last_stats.brief()
        self.border_title = f"● {self.title} · t={params.temperature:g}"
        self.state = state

    def watch_state(self, state: str) -> None:
        self.border_subtitle = state

    def on_resize(self, event: events.Resize) -> None:
        self.update_title()

    def add_line(self, text: str, kind: str) -> Static:
        """Append to the transcript; kind is a message role, "note" or "error". Answers are Markdown."""
        line = Static(chat_markdown(text) if kind == "assistant" else Text(text), classes=kind)
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
            self.run_worker(self._show_stats(), exit_on_error=False)
        elif outcome.action == "exit":
            self.app.close_session(self)
        self.update_title()

    def send(self, text: str) -> None:
        if self.answering:
            self.add_line("still answering; Esc stops the answer", "error")
            return
        self.add_line(text, "user")
        self.streamed_tokens, self.prompt_tokens = 0, None  # the last answer's figures are not this one's
        self.worker = self.run_worker(self._answer(text), exit_on_error=False)
        self.update_title()

    async def _show_stats(self) -> None:
        try:
            lines = await stats_report(self.app.client, self.conversation, self.last_stats)
        except EdgeserveError as exc:
            self.add_line(str(exc), "error")
        else:
            self.add_line("\n".join(lines), "note")

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
                reply.update(chat_markdown(turn.text))
                self.query_one(".transcript", VerticalScroll).scroll_end(animate=False)
                self.update_title()

        self.prompt_tokens = self.app.client.count_tokens(self.conversation.messages())
        self.request_id = f"session{self.number}-{next(self._request_numbers)}"
        self.update_title()
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


class Workspace(Horizontal):
    """The sessions and the engine panel, laid out afresh whenever the screen's size changes."""

    def on_resize(self, event: events.Resize) -> None:
        self.app.layout_sessions()


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
        Binding("ctrl+w", "close_session", "Close", priority=True),
        Binding("escape", "stop_answer", "Stop"),
        Binding("f2", "toggle_panel", "Engine"),
        # the input line opens the help itself on `?` while empty (MessageInput); this shows it in the footer
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("f1", "help", "Help", show=False),
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
        self.panel_wanted: bool | None = None  # F2's choice; None: by the width of the screen
        self._numbers = itertools.count(1)

    @property
    def sessions(self) -> list[SessionPane]:
        return list(self.query(SessionPane))

    def compose(self) -> ComposeResult:
        yield Header()
        with Workspace(id="main"):
            yield Container(id="sessions")
            yield self.status_panel
        yield Footer(show_command_palette=False)

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

    @property
    def panel_shown(self) -> bool:
        return self.panel_wanted if self.panel_wanted is not None else self.size.width >= WIDE

    def action_toggle_panel(self) -> None:
        self.panel_wanted = not self.panel_shown
        self.layout_sessions()

    def layout_sessions(self) -> None:
        """Show or hide the engine panel, and put as many sessions side by side as stay readable."""
        width = panel_width(self.size.width)
        self.status_panel.display = self.panel_shown
        self.status_panel.styles.width = width
        room = self.size.width - (width if self.panel_shown else 0)
        fit = max(1, room // MIN_SESSION_WIDTH)
        self.query_one("#sessions").styles.grid_size_columns = max(1, min(len(self.sessions), MAX_COLUMNS, fit))

    async def action_new_session(self) -> SessionPane:
        number = next(self._numbers)
        pane = SessionPane(number, SESSION_COLOURS[(number - 1) % len(SESSION_COLOURS)],
                           Conversation(self.system, [], dict(self.settings)))
        await self.query_one("#sessions").mount(pane)
        self.layout_sessions()
        pane.query_one(Input).focus()
        return pane

    def close_session(self, pane: SessionPane) -> None:
        """Close a session (stopping its answer); closing the last one opens a fresh one, not an empty screen."""
        pane.stop()
        sessions = self.sessions
        following = sessions[(sessions.index(pane) + 1) % len(sessions)] if len(sessions) > 1 else None
        pane.remove()
        self.call_after_refresh(self.layout_sessions)
        if following is not None:
            following.query_one(Input).focus()
        else:
            self.call_after_refresh(self.action_new_session)

    def action_close_session(self) -> None:
        pane = self.current_session()
        if pane is not None:
            self.close_session(pane)

    def action_stop_answer(self) -> None:
        pane = self.current_session()
        if pane is not None:
            pane.stop()

    def action_help(self) -> None:
        """Open the help, or close it (`?` reaches the app first, even over the help)."""
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())
