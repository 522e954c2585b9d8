"""An answer streamed into a terminal as Markdown: the latest lines of its rendering while it grows, all of it
once it ends (code blocks, lists and emphasis drawn by rich)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment


class _Tail:
    """The last `height` lines of a rendering: a live region taller than the screen cannot be redrawn."""

    def __init__(self, text: str, height: int):
        self.text = text
        self.height = height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(Markdown(self.text), options, pad=False)
        for line in lines[-self.height:]:
            yield from line
            yield Segment.line()


class MarkdownStream:
    """Feed it the answer's pieces with add(); end() leaves the whole answer rendered in the scrollback."""

    def __init__(self, console: Console):
        self.console = console
        self.text = ""
        self.live = Live(console=console, refresh_per_second=10, redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def add(self, text: str) -> None:
        self.text += text
        self.live.update(_Tail(self.text, max(1, self.console.size.height - 2)))

    def end(self) -> None:
        self.live.update(Markdown(self.text))
        self.live.stop()
