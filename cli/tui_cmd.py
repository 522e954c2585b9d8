"""`edgeserve tui`: several chat sessions at once, in-process or against a running server."""

from __future__ import annotations

import asyncio
import sys

import click
from click.core import ParameterSource

from edgeserve.cli.chat_clients import ChatClient, EngineClient, RemoteClient
from edgeserve.cli.options import build_engine, model_options, sampling_options
from edgeserve.config import EngineConfig
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingDefaults


def _check_terminal() -> None:
    """Refuse to start when the screen could not be drawn: Textual draws on stderr, so stderr must be a terminal.

    The error goes to stdout as well, since stderr is where it would be lost.
    """
    if sys.stderr.isatty():
        return
    message = ("the TUI draws on stderr, which is not a terminal here (was it redirected, as in 2>file?); "
               "run it with stderr on the terminal, or use `edgeserve chat`")
    click.echo(f"error: {message}")
    raise EdgeserveError(message)


async def _check(client: ChatClient) -> None:
    await client.start()
    await client.aclose()


@click.command()
@model_options
@click.option("--url", default=None,
              help="Talk to a running `edgeserve serve` (or any OpenAI-compatible server) at this address "
                   "instead of loading a model.")
@click.option("--api-key", envvar="EDGESERVE_API_KEY", default=None, help="API key for --url.")
@click.option("--system", default=None, help="System prompt of new sessions.")
@sampling_options(max_tokens=1024)
@click.pass_context
def tui(ctx: click.Context, model: str, config: EngineConfig, url: str | None,
        api_key: str | None, system: str | None, settings: dict) -> None:
    """Chat in several sessions side by side and watch the engine batch them (F1 or ? lists the keys).

    The sampling options set every new session's settings; /set changes one session's.
    """
    aengine = None
    if url:
        # a server picks its own model unless one was asked for
        chosen = None if ctx.get_parameter_source("model") == ParameterSource.DEFAULT else model
        client: ChatClient = RemoteClient(url, api_key, chosen)
        settings = SamplingDefaults().apply(settings)  # the server's model is not read here
        asyncio.run(_check(client))  # an unreachable server is one line of error, before the screen opens
        _check_terminal()
    else:
        _check_terminal()  # before the model loads
        engine = build_engine(model, config)
        from edgeserve.engine.async_engine import AsyncEngine  # imports the engine: after build_engine's note

        aengine = AsyncEngine(engine)
        client = EngineClient(aengine)
        settings = engine.model.sampling_defaults.apply(settings)
    from edgeserve.cli.tui_app import EdgeserveApp  # Textual, loaded only to open the screen

    try:
        app = EdgeserveApp(client, system, settings)
        app.run()
    finally:
        if aengine is not None:
            aengine.shutdown()
    if app.startup_error:
        raise EdgeserveError(app.startup_error)
