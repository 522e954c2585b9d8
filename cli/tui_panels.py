"""The TUI's live side panel: the model and engine figures, and the map of the paged KV pool."""

from __future__ import annotations

from collections.abc import Callable
from math import ceil

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from edgeserve.cli.chat_clients import ServingStatus, KVBlock
from edgeserve.units import format_size

# How each block state is drawn; a used or shared block takes the colour of the session holding it.
GLYPHS = {"used": "█", "shared": "▓", "cached": "░", "free": "·"}
_RANK = {"free": 0, "cached": 1, "used": 2, "shared": 3}  # which block a cell shows when it stands for several
OTHER_OWNER = "white"  # a request of no session here (another client of the server)
PANEL_WIDTH = 44
PANEL_MIN_WIDTH = 28  # the narrowest the panel gets, on a narrow screen


def panel_width(screen_width: int) -> int:
    """The engine panel's width: its full width on a wide screen, a third of a narrow one (the sessions come first)."""
    return min(PANEL_WIDTH, max(PANEL_MIN_WIDTH, screen_width // 3))

ColourOf = Callable[[str], "str | None"]


class KVMap(Widget):
    """One cell per KV block (or per few blocks, when the pool outgrows the panel)."""

    DEFAULT_CSS = "KVMap { height: 1fr; }"

    def __init__(self, colour_of: ColourOf, **kwargs: object):
        super().__init__(**kwargs)
        self.colour_of = colour_of
        self.blocks: list[KVBlock] | None = []  # None: the client has no map to give
        self.arrived = False  # whether the first snapshot of the pool has come

    def show(self, blocks: list[KVBlock] | None) -> None:
        self.blocks = blocks
        self.arrived = True
        self.refresh()

    def owners(self) -> set[str]:
        """The request ids holding blocks in the latest map."""
        return {o for b in self.blocks or [] for o in b.owners}

    def blocks_per_cell(self) -> int:
        """How many blocks one cell stands for, so that the whole pool fits the widget."""
        return max(1, ceil(len(self.blocks or []) / (max(1, self.size.width) * max(1, self.size.height))))

    def _cell(self, group: list[KVBlock]) -> tuple[str, str]:
        block = max(group, key=lambda b: _RANK[b.state])
        if block.state in ("used", "shared"):
            colour = next((c for c in map(self.colour_of, block.owners) if c), OTHER_OWNER)
            return GLYPHS[block.state], colour
        return GLYPHS[block.state], "grey50" if block.state == "cached" else "grey30"

    def render(self) -> Text:
        if not self.arrived:
            return Text("waiting for the first snapshot of the pool…", style="dim")
        if self.blocks is None:
            return Text("no KV map: the server does not publish one", style="dim")
        width, per_cell = max(1, self.size.width), self.blocks_per_cell()
        cells = [self._cell(self.blocks[i:i + per_cell]) for i in range(0, len(self.blocks), per_cell)]
        text = Text(no_wrap=True)
        for i, (glyph, style) in enumerate(cells):
            if i and i % width == 0:
                text.append("\n")
            text.append(glyph, style)
        return text


class StatusPanel(Vertical):
    """Model, backend and memory; running and waiting sequences, batch size, tokens/s; the KV map."""

    DEFAULT_CSS = """
    StatusPanel { width: %d; border: round $primary; padding: 0 1; }
    StatusPanel > #figures { height: auto; }
    StatusPanel > #kv-title { height: auto; margin-top: 1; text-style: bold; }
    StatusPanel > #kv-legend { height: auto; }
    """ % PANEL_WIDTH

    def __init__(self, model: str, runs_on: str, colour_of: ColourOf, **kwargs: object):
        super().__init__(**kwargs)
        self.model = model
        self.runs_on = runs_on
        self.status = ServingStatus()
        self.figures = Static(id="figures")
        self.kv_title = Static("KV pool", id="kv-title")
        self.kv_map = KVMap(colour_of, id="kv-map")
        self.kv_legend = Static(id="kv-legend")

    def compose(self) -> ComposeResult:
        yield self.figures
        yield self.kv_title
        yield self.kv_map
        yield self.kv_legend

    def on_mount(self) -> None:
        self.border_title = "engine"
        self.show_figures(self.status)  # the map waits for the first snapshot
        self.kv_legend.update(self.legend())

    def show(self, status: ServingStatus) -> None:
        """Show a snapshot of the engine: its figures and the KV map."""
        self.show_figures(status)
        self.kv_map.show(status.kv_blocks)
        self.kv_legend.update(self.legend())

    def show_figures(self, status: ServingStatus) -> None:
        self.status = status

        def figure(value: object, fmt: str = "{}") -> str:
            return "—" if value is None else fmt.format(value)

        lines = [
            f"model    {self.model}",
            f"backend  {self.runs_on}",
            "memory   " + ("—" if status.memory_bytes is None
                               else f"{format_size(status.memory_bytes)} (weights + KV pool)"),
            f"running  {figure(status.running)}   waiting {figure(status.waiting)}   batch {figure(status.batch_size)}",
            f"tokens/s {figure(status.tokens_per_second, '{:.1f}')}"
            + (f"   prefix hits {100 * status.prefix_hit_rate:.0f}%" if status.prefix_hit_rate is not None else ""),
        ]
        # a line only once speculative decoding has checked a guess, so that a short screen keeps the map
        if (guesses := status.guesses()) is not None:
            lines.append(f"guesses  {guesses}")
        self.figures.update(Text("\n".join(lines)))
        title = "KV pool"
        if status.kv_blocks is not None:
            counts = {s: sum(b.state == s for b in status.kv_blocks) for s in GLYPHS}
            title += (f": {len(status.kv_blocks)} blocks × {status.block_size} tokens\n"
                      + "  ".join(f"{n} {s}" for s, n in counts.items()))
        # prompt tokens the prefix store gave back instead of a prefill; a line only once there are some, so a
        # short screen keeps the map's legend
        if status.tier_hit_tokens and any(status.tier_hit_tokens.values()):
            title += "\nprefix store tokens: " + ", ".join(f"{n} {t}" for t, n in status.tier_hit_tokens.items())
        self.kv_title.update(Text(title))

    def legend(self) -> Text:
        """What the glyphs mean, and how many blocks (of how many tokens) one cell stands for."""
        text = Text()
        for state in ("used", "shared", "cached", "free"):
            text.append(f"{GLYPHS[state]} {state}  ", "grey50" if state in ("cached", "free") else "bold")
        per_cell = self.kv_map.blocks_per_cell()
        size = f" of {self.status.block_size} tokens" if self.status.block_size else ""
        text.append(f"\none cell: {per_cell} block{'s' if per_cell > 1 else ''}{size}", "dim")
        text.append("\ncolour: the session holding the block", "dim")
        return text
