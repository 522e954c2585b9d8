"""`edgeserve cache ls|clear`: the prefix store's disk tier, by model namespace."""

from __future__ import annotations

import time
from pathlib import Path

import click

from edgeserve.errors import EdgeserveError
from edgeserve.units import format_size


@click.group("cache")
def cache_group() -> None:
    """List or clear the prefix cache on disk (K/V of prompt prefixes kept across restarts), per model."""


@cache_group.command("ls")
def ls() -> None:
    """List the disk tier's entries per model namespace (model, KV dtype, block size): entries, size, last use.
    The RAM tier belongs to a running engine: its hits and size are in a server's /metrics."""
    from edgeserve.engine.prefix_store import namespaces, store_root

    spaces = namespaces()
    click.echo(f"prefix cache on disk: {store_root()}")
    if not spaces:
        click.echo("  (empty)")
        return
    click.echo(f"  {'MODEL':32} {'KV':8} {'BLOCK':>5} {'ENTRIES':>8} {'SIZE':>10}  LAST USED")
    for s in spaces:
        used = "-" if s.last_used is None else f"{_ago(time.time() - s.last_used)} ago"
        click.echo(f"  {s.meta.get('model', s.path.name)[:32]:32} {s.meta.get('kv_dtype', '?'):8} "
                   f"{s.meta.get('block_size', '?'):>5} {s.entries:>8} {format_size(s.bytes):>10}  {used}")
    click.echo(f"  total {sum(s.entries for s in spaces)} entries, {format_size(sum(s.bytes for s in spaces))}")


@cache_group.command("clear")
@click.option("--model", "-m", default=None, help="Only this model's entries (its catalog name, file or folder)  "
                                                   "[default: every model's]")
def clear(model: str | None) -> None:
    """Delete the disk tier's entries (a running server keeps its RAM tier and writes on)."""
    from edgeserve.engine.prefix_store import clear as clear_spaces, namespaces

    spaces = namespaces()
    if model is not None:
        wanted = _names(model)
        spaces = [s for s in spaces if wanted & {s.meta.get("model"), s.meta.get("path"),
                                                 Path(s.meta.get("model", "")).stem}]
        if not spaces:
            raise EdgeserveError(f"no prefix-cache entries for model {model!r} (`edgeserve cache ls` lists them)")
    freed = clear_spaces(spaces)
    click.echo(f"cleared {len(spaces)} namespace{'' if len(spaces) == 1 else 's'}, {format_size(freed)}")


def _names(model: str) -> set[str]:
    """What a namespace's meta may call this model: the name given, its file or folder name and path, its catalog file."""
    from edgeserve.models.catalog import CATALOG

    path = Path(model).expanduser()
    names = {model, path.name, path.stem, str(path.resolve())}
    if model in CATALOG:
        names.add(CATALOG[model].filename)
    return names


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
