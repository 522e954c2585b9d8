"""`edgeserve convert` (quantize into an MLX-format folder) and `edgeserve eval perplexity`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from edgeserve.cli.options import build_engine, model_options
from edgeserve.config import EngineConfig
from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import load_model
from edgeserve.quant.convert import check_output, convert
from edgeserve.quant.perplexity import text_perplexity
from edgeserve.quant.report import SHIPPED_TEXT, SHIPPED_TEXT_TITLE, quality_report
from edgeserve.units import format_size

PERPLEXITY_WINDOW = 512  # tokens, where --ctx-size is not given


@click.command("convert")
@click.argument("source")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Output folder (MLX format).")
@click.option("--bits", type=click.Choice(["4", "8", "16"]), default="4", show_default=True,
              help="Width of the layers' weights; 16 writes float16.")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default=None,
              help="Values per quantization group  [default: a quantized source's own (GGUF: 32), else 64]")
@click.option("--keep-embeddings", type=click.Choice(["8", "16"]), default="8", show_default=True,
              help="Width of the embeddings and output head (never below --bits).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--report", is_flag=True,
              help="Then print each layer's weight error and the perplexity of source and result.")
def convert_cmd(source: str, out: Path, bits: str, group_size: str | None, keep_embeddings: str,
                force: bool, report: bool) -> None:
    """Convert SOURCE (GGUF file, model folder, catalog name or hub id) into an MLX-format folder.

    mlx-lm loads the result as well as edgeserve. GGUF Q4_0/Q4_1/Q8_0 weights carry over
    without requantizing; the source is never modified, and a failed or interrupted run leaves
    no OUT behind.
    """
    check_output(out, force)  # before the slow load
    model = load_model(source)
    result = convert(
        model, out, bits=int(bits), group_size=int(group_size) if group_size else None,
        keep_embeddings=int(keep_embeddings), force=force, measure_errors=report,
    )
    click.echo(f"wrote {out} ({result.describe()}; {format_size(result.total_bytes)} of weights)")
    if report:
        click.echo(quality_report(model, result))


@click.group("eval")
def eval_group() -> None:
    """Measure a model's quality."""


@eval_group.command("perplexity")
@model_options
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help=f"UTF-8 text file  [default: {SHIPPED_TEXT_TITLE}]")
def perplexity_cmd(model: str, config: EngineConfig, text_path: Path | None) -> None:
    """Perplexity of a model on a text, over sliding windows of --ctx-size tokens (default 512) that
    overlap by half."""
    ctx = config.max_model_len or PERPLEXITY_WINDOW
    config = dataclasses.replace(config, max_model_len=ctx)
    try:
        text = (text_path or SHIPPED_TEXT).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EdgeserveError(f"{text_path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    engine = build_engine(model, config)
    result = text_perplexity(engine, text, ctx)
    click.echo(f"{result.describe()} on {text_path or SHIPPED_TEXT_TITLE}")
