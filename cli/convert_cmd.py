"""`edgeserve convert` (quantize into an MLX-format folder), `edgeserve eval perplexity` and `edgeserve eval kv`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from edgeserve.cli.local_models import record_conversion
from edgeserve.cli.options import build_engine, model_options
from edgeserve.config import EngineConfig
from edgeserve.errors import EdgeserveError
from edgeserve.evaluation.shipped_text import SHIPPED_TEXT, SHIPPED_TEXT_TITLE
from edgeserve.system import usable_cores
from edgeserve.units import format_size

if TYPE_CHECKING:
    from edgeserve.models.convert import ConversionResult
    from edgeserve.models.loader import LoadedModel

PERPLEXITY_WINDOW = 512  # tokens, where --ctx-size is not given
# Perplexity work one CPU core does per second, in parameters x tokens scored: enough for an estimate
# that says seconds or minutes or hours. 4e10 promised 75 s for --report on Gemma 3 270M Q4_K_M, which
# took 5 minutes: every scored token also runs the full output head and a log-softmax over the vocabulary.
# 1e10 then; 2e10 once the CPU kernels' gates and activation quantizing were vectorized (SmolLM2 135M
# measured 0.4 of 1e10's estimate).
CPU_PARAM_TOKENS_PER_CORE_S = 2e10
# A matrix error (||W - W'|| / ||W||) from which a conversion is worth a warning: 4-bit groups of a float
# model land near 10%; float16 and the source's own groups kept stay far below.
NOTICEABLE_ERROR = 0.01


def source_layer_bits(model: LoadedModel) -> int | None:
    """The widest width of the source's quantized layer matrices; None where any of them is not quantized."""
    import numpy as np

    from edgeserve.quant.affine import QuantizedTensor
    from edgeserve.quant.kquants import KQuantTensor

    widths = []
    for name, w in model.weights.items():
        if ".layers." not in name:
            continue
        if isinstance(w, QuantizedTensor):
            widths.append(w.bits)
        elif isinstance(w, KQuantTensor):
            widths.append(int(w.qtype.name[1]))  # Q4_K, Q5_K, Q6_K
        elif np.ndim(w) == 2:
            return None
    return max(widths, default=None)


def requantized(model: LoadedModel, result: ConversionResult) -> list[str]:
    """The matrices whose quantized source groups were replaced by new ones: their errors add to the source's."""
    from edgeserve.quant.affine import QuantizedTensor
    from edgeserve.quant.kquants import KQuantTensor

    return [p.name for p in result.plans
            if p.action == "quantize" and isinstance(model.weights.get(p.name), (QuantizedTensor, KQuantTensor))]


def quality_estimate(model: LoadedModel, result: ConversionResult) -> str | None:
    """One line on what the conversion cost in weight error, a warning where it is noticeable; None if nothing."""
    errors = result.relative_errors
    if not errors:
        return None
    worst = max(errors, key=errors.__getitem__)
    mean = sum(errors.values()) / len(errors)
    figures = (f"matrices changed by {100 * mean:.1f}% on average, {100 * errors[worst]:.1f}% at most "
               f"({worst.removesuffix('.weight')})")
    if errors[worst] < NOTICEABLE_ERROR:
        return f"quality: {figures}; no loss to speak of"
    again = requantized(model, result)
    cause = (f"re-quantizing {len(again)} already quantized matrices adds new rounding to the source's, "
             f"which costs more than quantizing the original weights once" if again else "quantizing rounds weights")
    return f"warning: {figures}: {cause}; expect higher perplexity (--report measures it)"


def conversion_summary(model: LoadedModel, result: ConversionResult) -> str:
    """e.g. '4-bit, group 32, 3 matrices wider; 4.85 bits per weight, 81.2 MiB': not every matrix listed."""
    main = "float16" if result.group_size is None else f"{result.bits}-bit, group {result.group_size}"
    wider = sum(p.is_matrix and (p.bits, p.group_size) != (result.bits, result.group_size) for p in result.plans)
    bits_per_weight = 8 * result.total_bytes / max(model.num_parameters, 1)
    return (f"{main}{f', {wider} matrices wider' if wider else ''}; {bits_per_weight:.2f} bits per weight, "
            f"{format_size(result.total_bytes)}")


def report_notice(model: LoadedModel) -> str:
    """What --report is about to do, and roughly how long it takes."""
    from edgeserve.evaluation.perplexity import windows
    from edgeserve.evaluation.quality_report import REPORT_CTX

    tokens = len(model.tokenizer.encode(SHIPPED_TEXT.read_text(encoding="utf-8")))
    count = len(windows(tokens, REPORT_CTX, REPORT_CTX // 2))
    seconds = 2 * count * REPORT_CTX * model.num_parameters / (CPU_PARAM_TOKENS_PER_CORE_S * usable_cores())
    rough = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    return (f"--report computes perplexity twice, {count} windows of {REPORT_CTX} tokens each: "
            f"1/2 the source, then 2/2 the converted model (roughly {rough} on this CPU; the bars show "
            f"what is left)")


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
              help="Then print each layer's weight error and the perplexity of source and result "
                   "(without it, one line estimates the loss from the weight errors).")
def convert_cmd(source: str, out: Path, bits: str, group_size: str | None, keep_embeddings: str,
                force: bool, report: bool) -> None:
    """Convert SOURCE (GGUF file, model folder, catalog name or hub id) into an MLX-format folder.

    mlx-lm loads the result as well as edgeserve. GGUF Q4_0/Q4_1/Q8_0 weights carry over
    without requantizing; the source is never modified, and a failed or interrupted run leaves
    no OUT behind.
    """
    # the conversion's modules import NumPy and the engine: loaded when it runs, not for --help
    from edgeserve.models.loader import load_model
    from edgeserve.models.convert import check_output, convert
    from edgeserve.evaluation.quality_report import quality_report

    check_output(out, force)  # before the slow load
    model = load_model(source)
    width = source_layer_bits(model)
    if width is not None and int(bits) > width:
        click.echo(f"note: the source's layers are {width}-bit; {bits}-bit holds the same values in more bytes, "
                   f"so it cannot gain quality over the source", err=True)
    if report:
        click.echo(report_notice(model), err=True)
    result = convert(
        model, out, bits=int(bits), group_size=int(group_size) if group_size else None,
        keep_embeddings=int(keep_embeddings), force=force, measure_errors=True,
    )
    summary = conversion_summary(model, result)
    try:
        record_conversion(out, source, summary)
    except OSError as exc:  # the folder is fine; only `edgeserve models` will not list it
        click.echo(f"note: could not record {out} for `edgeserve models`: {exc}", err=True)
    click.echo(f"wrote {out} ({summary})")
    if (estimate := quality_estimate(model, result)) is not None:
        click.echo(estimate, err=True)
    if report:
        click.echo(quality_report(model, result))


@click.group("eval")
def eval_group() -> None:
    """Measure a model's quality."""


@eval_group.command("perplexity")
@model_options(ctx_default=str(PERPLEXITY_WINDOW), generates=False)
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help=f"UTF-8 text file  [default: {SHIPPED_TEXT_TITLE}]")
def perplexity_cmd(model: str, config: EngineConfig, text_path: Path | None) -> None:
    """Perplexity of a model on a text, over sliding windows of --ctx-size tokens (default 512) that
    overlap by half."""
    ctx = config.max_model_len or PERPLEXITY_WINDOW
    config = dataclasses.replace(config, max_model_len=ctx)
    text = read_text(text_path)
    engine = build_engine(model, config)
    from edgeserve.evaluation.perplexity import text_perplexity  # imports the engine: after build_engine's note

    result = text_perplexity(engine, text, ctx)
    click.echo(f"{result.describe()} on {text_path or SHIPPED_TEXT_TITLE}")


@eval_group.command("kv")
@model_options(ctx_default=str(PERPLEXITY_WINDOW), generates=False)
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help=f"UTF-8 text file  [default: {SHIPPED_TEXT_TITLE}]")
def kv_cmd(model: str, config: EngineConfig, text_path: Path | None) -> None:
    """What each KV dtype costs a model: perplexity, KL divergence and top-1 agreement against the float32 pool,
    over the windows `eval perplexity` scores (the NumPy backend; --kv-dtype adds nothing here)."""
    if config.backend == "mlx":
        raise EdgeserveError("eval kv compares the numpy backend's KV dtypes; drop --backend mlx")
    ctx = config.max_model_len or PERPLEXITY_WINDOW
    text = read_text(text_path)
    from edgeserve.backends import KV_DTYPES
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.evaluation.kv_quality import kv_quality
    from edgeserve.models.loader import load_model

    loaded = load_model(model)
    base = dataclasses.replace(config, backend="numpy", max_model_len=ctx, enable_prefix_caching=False)
    engines = {dtype: LLMEngine(loaded, dataclasses.replace(base, kv_dtype=dtype)) for dtype in KV_DTYPES}
    rows = kv_quality(engines, text, ctx)
    click.echo(f"{loaded.source.name}: KV dtypes on {text_path or SHIPPED_TEXT_TITLE} ({rows[0].tokens} tokens "
               f"scored, windows of {ctx})")
    click.echo(f"{'KV dtype':>9}  {'tokens/GiB':>10}  {'perplexity':>10}  {'vs float32':>10}  {'KL (nats)':>9}  "
               f"{'top-1 same':>10}")
    reference = rows[0].perplexity
    for r in rows:
        click.echo(f"{r.kv_dtype:>9}  {r.tokens_per_gib:>10}  {r.perplexity:>10.4f}  "
                   f"{(r.perplexity / reference - 1) * 100:>+9.2f}%  {r.kl_divergence:>9.2e}  {r.top1_agreement:>10.2%}")


def read_text(path: Path | None) -> str:
    """The user's text file, or the shipped one; a clear error where it is not UTF-8."""
    try:
        return (path or SHIPPED_TEXT).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EdgeserveError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
