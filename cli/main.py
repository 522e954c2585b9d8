"""The `edgeserve` command: one group, each command in its own module."""

from __future__ import annotations

import sys

import click

from edgeserve.errors import EdgeserveError


class Group(click.Group):
    """Turns user-facing errors into one line on stderr and a non-zero exit, never a traceback."""

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


def _register() -> None:
    from edgeserve.cli.bench_cmd import bench_cmd
    from edgeserve.cli.chat_cmd import chat
    from edgeserve.cli.convert_cmd import convert_cmd, eval_group
    from edgeserve.cli.model_cmds import info, models, pull, rm
    from edgeserve.cli.ps_cmd import ps
    from edgeserve.cli.run_cmd import run
    from edgeserve.cli.serve_cmd import serve
    from edgeserve.cli.tui_cmd import tui

    for command in (run, pull, models, rm, ps, info, serve, chat, tui, convert_cmd, eval_group, bench_cmd):
        cli.add_command(command)


_register()
