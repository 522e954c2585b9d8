"""`edgeserve serve`: the OpenAI-compatible server, on loopback by default."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import click

from edgeserve.cli.options import build_engine, join_group, model_options
from edgeserve.config import DEFAULT_SERVE_PREFIX_CACHE_DISK, EngineConfig
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, cached_path, names_for_file
from edgeserve.server import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_QUEUE, DEFAULT_SHUTDOWN_TIMEOUT
from edgeserve.units import parse_size

DEFAULT_MAX_LOADED_MODELS = 3  # as Ollama keeps on a CPU


def served_model_name(model: str) -> str:
    """The id clients pass as `model`: a catalog name or hub id as given, else the file or folder name."""
    path = Path(model).expanduser()
    if model in CATALOG or not path.exists():
        return model
    return path.stem if path.is_file() else path.name


def models_in(folder: Path) -> list[str]:
    """The models a folder holds: its GGUF files and its model folders (those with a config.json), by name."""
    if not folder.is_dir():
        raise EdgeserveError(f"--models-dir {folder}: no such folder")
    found = [p for p in sorted(folder.iterdir())
             if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file())]
    if not found:
        raise EdgeserveError(f"--models-dir {folder}: no GGUF file or model folder inside")
    return [str(p) for p in found]


def catalog_names(source: str, taken: set[str]) -> tuple[str, ...]:
    """The catalog's names for a model file, which requests may use too (unless another model has the name)."""
    return tuple(n for n in names_for_file(Path(source).name) if n not in taken)


def expected_bytes(source: str) -> int:
    """A model's weights as its files measure them, before it loads (0 where they are not on disk yet)."""
    entry = CATALOG.get(source)
    path = (cached_path(entry) if entry is not None else None) or Path(source).expanduser()
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0


def _keep_alive(value: str | None) -> float | None:
    from edgeserve.server.models import parse_keep_alive

    try:
        return None if value is None else parse_keep_alive(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--keep-alive") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    """Bind the port now, before the slow model load, so a taken port fails at once."""
    # IPPROTO_TCP named, not 0: asyncio turns on TCP_NODELAY only for sockets that say TCP, and without it a
    # kept-alive connection's whole (non-streamed) answer waits ~40 ms on the client's delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EdgeserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


@click.command()
@model_options(several=True, prefix_cache_disk=DEFAULT_SERVE_PREFIX_CACHE_DISK, distributed=True)
@click.option("--models-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Serve every GGUF file and model folder in this folder too (each by its name).")
@click.option("--max-loaded-models", default=DEFAULT_MAX_LOADED_MODELS, show_default=True, type=click.IntRange(1),
              help="Models held in memory at once; a request for another unloads the one used least lately "
                   "(never one answering a request: the new request waits).")
@click.option("--max-memory", default=None, metavar="SIZE",
              help="Memory the loaded models may take together (weights and KV pools: 8GiB, 16GB); a request for a "
                   "model that does not fit unloads others, as --max-loaded-models does.")
@click.option("--allow-pull", is_flag=True,
              help="Serve any catalog model a request names, pulled (downloaded) and loaded on its first request.")
@click.option("--keep-alive", default=None, metavar="DURATION",
              help="How long a model stays loaded once idle (30s, 5m, 1h; negative: for ever), unless a "
                   "request's keep_alive says otherwise  [default: for ever with one model, else 5m]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback exposes the model to your network.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port to listen on; 0 picks a free one.")
@click.option("--alias", "aliases", multiple=True, metavar="NAME",
              help="Another name for the (first) model to answer to (repeatable), for clients with a hard-coded "
                   "one; other names stay 404.")
@click.option("--api-key", envvar="EDGESERVE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 (default: $EDGESERVE_API_KEY).")
@click.option("--max-queue", default=DEFAULT_MAX_QUEUE, show_default=True, type=click.IntRange(1),
              help="Requests running or waiting beyond which new ones are refused with 429.")
@click.option("--max-body-size", default=DEFAULT_MAX_BODY_SIZE, show_default=True, type=click.IntRange(1),
              help="Largest request body in bytes; larger ones are refused with 413.")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="A Host name to accept besides loopback names and IP addresses (repeatable; '*' accepts "
                   "any). Others get 403, which stops DNS-rebinding web pages.")
@click.option("--cors-origins", default=None, metavar="ORIGINS",
              help="Web origins (comma-separated, e.g. http://localhost:3000) whose pages may call the API from a "
                   "browser; off by default. '*' (any page) needs --cors-allow-all too.")
@click.option("--cors-allow-all", is_flag=True, help="Let --cors-origins be '*': any web page you open may call "
                                                     "the API (set --api-key).")
@click.option("--web/--no-web", default=True, show_default=True,
              help="Serve the web chat at / (a page that uses the API as any client does, the API key too).")
@click.option("--shutdown-timeout", default=DEFAULT_SHUTDOWN_TIMEOUT, show_default=True, type=click.FloatRange(0),
              help="On SIGTERM or Ctrl-C, seconds running requests get to finish (new ones get 503) before the "
                   "rest are aborted. A second signal aborts them at once.")
def serve(models: tuple[str, ...], config: EngineConfig, models_dir: Path | None, max_loaded_models: int,
          max_memory: str | None, allow_pull: bool, keep_alive: str | None, host: str, port: int, api_key: str | None,
          aliases: tuple[str, ...], max_queue: int, max_body_size: int, allowed_hosts: tuple[str, ...],
          cors_origins: str | None, cors_allow_all: bool, web: bool, shutdown_timeout: float) -> None:
    """Serve models over the OpenAI, Anthropic and Ollama APIs (completions, Responses, Messages, /api/chat;
    streaming) for local tools. The first model loads now; others load on their first request."""
    origins = [o.strip().rstrip("/") for o in (cors_origins or "").split(",") if o.strip()]
    if "*" in origins and not cors_allow_all:
        raise click.UsageError("--cors-origins '*' lets every web page you open use this server; add "
                               "--cors-allow-all to mean it")
    idle_seconds = _keep_alive(keep_alive)
    budget = parse_size(max_memory) if max_memory else None
    sources = list(dict.fromkeys([*models, *(models_in(models_dir) if models_dir else [])])) or [DEFAULT_MODEL]
    names = [served_model_name(m) for m in sources]
    if len(set(names)) < len(names):
        raise click.UsageError(f"two models would be served under one name: {', '.join(names)}")
    if config.draft_model is not None and len(sources) > 1:
        raise click.UsageError("--draft-model drafts for one model: serve only that one")
    aliases = tuple(a for a in dict.fromkeys(aliases) if a != names[0])
    if clash := set(aliases) & set(names):
        raise click.UsageError(f"--alias {sorted(clash)[0]} is the name of another model served")
    if config.distributed and (len(sources) > 1 or allow_pull or keep_alive is not None):
        raise click.UsageError("--distributed serves one model, loaded for the server's life (no second model, "
                               "--models-dir, --allow-pull or --keep-alive)")
    join_group(sources[0], config)  # ranks but 0 serve rank 0's steps here, and never listen
    config = dataclasses.replace(config, populate_kv=True)  # a long life: its pool's pages mapped in at start
    sock = _listen(host, port)
    engine = build_engine(sources[0], config)
    # the server's modules (FastAPI, uvicorn) load here, so --help and a taken port answer at once
    import uvicorn

    from edgeserve.engine.async_engine import AsyncEngine
    from edgeserve.server.app import create_app
    from edgeserve.server.connections import ACCEPT_BACKLOG, IDLE_TIMEOUT, IdleClosingH11, connection_limit
    from edgeserve.server.models import DEFAULT_KEEP_ALIVE, FOREVER, ModelEntry, ModelPool
    from edgeserve.server.shutdown import FLUSH_TIMEOUT, DrainingServer

    def loader(source: str) -> Callable[[], AsyncEngine]:
        return lambda: AsyncEngine(build_engine(source, config, quiet=True))

    if idle_seconds is None:
        idle_seconds = FOREVER if len(sources) == 1 else DEFAULT_KEEP_ALIVE
    kv_bytes = config.kv_budget_bytes()
    taken = {*names, *aliases}
    # a split model stays loaded (pinned: no load function): its other ranks serve one engine's life
    entries = [ModelEntry(name, aliases if i == 0 else (), catalog_names(source, taken),
                          load=None if config.distributed else loader(source), size=expected_bytes(source) + kv_bytes)
               for i, (name, source) in enumerate(zip(names, sources))]
    pool = ModelPool(entries, max_loaded_models, idle_seconds, loader, allow_pull, budget)
    pool.preload(entries[0], AsyncEngine(engine))
    app = create_app(pool, api_key=api_key, max_queue=max_queue, max_body_size=max_body_size,
                     allowed_hosts=(host, *allowed_hosts), cors_origins=origins, web=web)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if not api_key and not _is_loopback(host):
        click.echo(f"warning: listening on {host} without an API key; anyone who can reach it can use it", err=True)
    address = f"[{host}]" if ":" in host else host
    listed = ", ".join(n for e in entries for n in e.names)
    base = f"http://{address}:{sock.getsockname()[1]}"
    chat = f", the web chat at {base}/" if web else ""
    click.echo(f"serving {listed} at {base}/v1{chat} (Ctrl-C stops)")
    http_config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=FLUSH_TIMEOUT,
                                 http=IdleClosingH11, timeout_keep_alive=IDLE_TIMEOUT,
                                 limit_concurrency=connection_limit(), backlog=ACCEPT_BACKLOG)
    try:
        DrainingServer(http_config, app.state.server, shutdown_timeout).run(sockets=[sock])
    finally:
        pool.shutdown()
