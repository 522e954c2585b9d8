"""Options shared by the commands that load a model, and building the engine from them."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import click

from edgeserve.backends import BACKENDS, WEIGHT_MODES
from edgeserve.config import DEFAULT_KV_MEMORY, EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.models.loader import load_model


def model_options(run: Callable) -> Callable:
    """--model, and the engine's --backend, --weights, --kv-memory and --threads, which reach the
    command as one EngineConfig argument `config`."""

    @functools.wraps(run)
    def command(*args: object, backend: str, weights: str, kv_memory: str, threads: int | None,
                **kwargs: object) -> object:
        config = EngineConfig(backend=backend, weights=weights, kv_memory=kv_memory, threads=threads)
        return run(*args, config=config, **kwargs)

    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads for the NumPy backend's kernels  [default: every core]")(command)
    f = click.option("--kv-memory", default=DEFAULT_KV_MEMORY, show_default=True,
                     help="KV pool size: 2GiB, 512MiB, or a fraction of free memory (0.25, 25%).")(f)
    f = click.option("--weights", type=click.Choice(["auto", *WEIGHT_MODES]), default="auto", show_default=True,
                     help="NumPy backend: compute from the quantized storage (least memory, fastest where "
                          "the C kernels built) or float32 copies (the exact reference); auto picks.")(f)
    f = click.option("--backend", default="auto", show_default=True,
                     help=f"Array backend ({', '.join(BACKENDS)}): auto takes MLX on a GPU, NumPy on the CPU.")(f)
    f = click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                     help="Catalog name, local GGUF file or model folder, or Hugging Face hub id.")(f)
    return f


def build_engine(model: str, config: EngineConfig, quiet: bool = False) -> LLMEngine:
    """Load the model and start an engine, printing what was allocated to stderr."""
    loaded = load_model(model)
    engine = LLMEngine(loaded, config)
    if not quiet:
        print(f"{loaded.source.name} on {engine.backend.describe()}; {engine.pool_size.describe()}", file=sys.stderr)
        if (note := engine.describe_limits()) is not None:
            print(note, file=sys.stderr)
    return engine
