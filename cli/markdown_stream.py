"""An answer streamed into a terminal as Markdown: each block printed for good once the next one begins, the
block still growing redrawn in place below them, all of it whole in the scrollback once it ends (code blocks,
lists and emphasis drawn by rich, the answer's line breaks kept)."""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.segment import Segment

from edgeserve.cli.chat_markdown import PARSER, chat_markdown


def _wrapping(options: ConsoleOptions) -> ConsoleOptions:
    """Options that wrap long lines at the screen's width, whatever the console's soft_wrap says."""
    return options.update(no_wrap=False, overflow="fold")


class _Tail:
    """The last `height` lines of a rendering: a live region taller than the screen cannot be redrawn."""

    def __init__(self, text: str, height: int):
        self.text = text
        self.height = height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(chat_markdown(self.text), _wrapping(options), pad=False)
        for line in lines[-self.height:]:
            yield from line
            yield Segment.line()


class _Whole:
    """All of a rendering, wrapped."""

    def __init__(self, text: str):
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from console.render(chat_markdown(self.text), _wrapping(options))


def finished_blocks(text: str) -> tuple[int, bool]:
    """How many characters of text hold whole Markdown blocks (those before the block still growing), and
    whether the last of them wants a blank line after it (all do but a rule, which draws its own)."""
    blocks = [t for t in PARSER.parse(text) if t.level == 0 and t.nesting >= 0 and t.map]
    if len(blocks) < 2:
        return 0, False
    # a block is whole once another has begun after it: its lines end where the last one's start
    cut = sum(len(line) + 1 for line in text.split("\n")[:blocks[-1].map[0]])
    return cut, blocks[-2].type != "hr"


class MarkdownStream:
    """Feed it the answer's pieces with add(); end() leaves the whole answer rendered in the scrollback.

    Whole blocks are printed above the live region as soon as the next block begins, so the scrollback
    holds them however long the answer grows; only the last block is redrawn, and only as much of it as
    the screen holds until it ends.
    """

    def __init__(self, console: Console):
        self.console = console
        self.text = ""
        self.printed = 0  # characters of text printed for good above the live region
        self.live = Live(console=console, refresh_per_second=10, redirect_stdout=False, redirect_stderr=False,
                         vertical_overflow="visible")
        self.live.start()

    def add(self, text: str) -> None:
        self.text += text
        cut, blank_after = finished_blocks(self.text[self.printed:])
        if cut:
            whole = self.text[self.printed:self.printed + cut]
            self.printed += cut
            # the finished blocks leave the live region (cleared first, so no frame shows them twice) and are
            # printed above it, into the scrollback
            self.live.update("", refresh=True)
            self.console.print(_Whole(whole), soft_wrap=False)
            if blank_after:
                self.console.print()
        self.live.update(_Tail(self.text[self.printed:], max(1, self.console.size.height - 2)))

    def end(self) -> None:
        self.live.update(_Whole(self.text[self.printed:]))
        self.live.stop()
