"""The quality report of a conversion: relative error per layer, perplexity before and after."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from edgeserve.engine.kv_budget import kv_bytes_per_token
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.evaluation.perplexity import PerplexityResult, text_perplexity
from edgeserve.evaluation.shipped_text import SHIPPED_TEXT, SHIPPED_TEXT_TITLE
from edgeserve.models.convert import ConversionResult
from edgeserve.models.loader import LoadedModel, load_folder

REPORT_CTX = 512

_LAYER_MATRIX = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.weight")
_KINDS = ("q", "k", "v", "o", "gate", "up", "down")


def layer_error_table(errors: dict[str, float]) -> str:
    """Relative errors laid out one row per layer and one column per matrix, then the rest."""
    layers: dict[int, dict[str, float]] = {}
    others: dict[str, float] = {}
    for name, err in errors.items():
        m = _LAYER_MATRIX.fullmatch(name)
        if m and m[2] in _KINDS:
            layers.setdefault(int(m[1]), {})[m[2]] = err
        else:
            others[name.removesuffix(".weight")] = err
    lines = ["layer " + "".join(f"{k:>8}" for k in _KINDS) + f"{'mean':>8}"]
    for i in sorted(layers):
        row = layers[i]
        cells = "".join(f"{_pct(row[k]) if k in row else '-':>8}" for k in _KINDS)
        lines.append(f"{i:>5} {cells}{_pct(float(np.mean(list(row.values())))):>8}")
    lines += [f"{name}: {_pct(err)}" for name, err in others.items()]
    if errors:
        worst = max(errors, key=errors.__getitem__)
        lines.append(f"all matrices: mean {_pct(float(np.mean(list(errors.values()))))}, "
                     f"max {_pct(errors[worst])} ({worst.removesuffix('.weight')})")
    return "\n".join(lines)


def model_perplexity(
    model: LoadedModel, text: str, ctx: int = REPORT_CTX, backend: str = "auto", progress: bool = True,
    label: str = "perplexity",
) -> tuple[PerplexityResult, str]:
    """Perplexity of a loaded model on a text, and the name of the backend that computed it."""
    # The KV pool needs one window (plus a block of slack) at float32, the widest KV dtype.
    kv_bytes = kv_bytes_per_token(model.args, "float32") * (ctx + 64)
    engine = LLMEngine(model, backend=backend, kv_memory=kv_bytes)
    return text_perplexity(engine, text, ctx, progress=progress, label=label), engine.backend.name


def quality_report(
    source: LoadedModel,
    result: ConversionResult,
    text_path: Path = SHIPPED_TEXT,
    ctx: int = REPORT_CTX,
    backend: str = "auto",
    progress: bool = True,
) -> str:
    """Per-layer relative error of `result` (converted with measure_errors) and the perplexity
    of source and result on a text (by default the one that ships with edgeserve)."""
    text = text_path.read_text(encoding="utf-8")
    title = SHIPPED_TEXT_TITLE if text_path == SHIPPED_TEXT else str(text_path)
    before, backend_name = model_perplexity(source, text, ctx, backend, progress, "perplexity 1/2: source")
    after, _ = model_perplexity(load_folder(result.out), text, ctx, backend, progress, "perplexity 2/2: converted")
    change = 100 * (after.perplexity / before.perplexity - 1)
    return "\n".join([
        f"Quality of {result.out} ({result.describe()}) against {source.source.name}",
        "",
        "Relative error ||W - W'|| / ||W|| of each matrix against the source's own values "
        "(0 where the source's groups were kept exactly):",
        layer_error_table(result.relative_errors),
        "",
        f"Perplexity on {title}: {after.tokens} tokens scored, ctx {ctx}, stride {after.stride}, "
        f"{backend_name} backend",
        f"  source  {before.perplexity:.4f}",
        f"  result  {after.perplexity:.4f}  ({change:+.2f}%)",
    ])


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"
