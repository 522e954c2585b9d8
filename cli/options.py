"""Options shared by the commands that load a model, and building the engine from them."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from edgeserve.backends import ACTIVATION_MODES, BACKENDS, DEFAULT_ACTIVATIONS, KV_DTYPES, WEIGHT_MODES
from edgeserve.config import (DEFAULT_KV_MEMORY, DEFAULT_PREFIX_CACHE_RAM, DISTRIBUTED_MODES, SPECULATIVE_MODES,
                              EngineConfig)
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.sampling_params import FALLBACK_SAMPLING, SamplingDefaults, SamplingParams

if TYPE_CHECKING:
    from edgeserve.engine.llm_engine import LLMEngine


class BackendChoice(click.Choice):
    """The backends, listed in --help; an unknown one is the one-line error every command gives."""

    def __init__(self) -> None:
        super().__init__(BACKENDS)

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> object:
        if value not in self.choices:
            raise EdgeserveError(f"unknown backend {value!r} (choose from {', '.join(self.choices)})")
        return value


def model_options(run: Callable | None = None, *, ctx_default: str = "the model's", several: bool = False,
                  generates: bool = True, prefix_cache_disk: str = "0", distributed: bool = False) -> Callable:
    """--model, and the engine's --backend, --weights, --activations, --kv-memory, --kv-dtype, --threads, --ctx-size
    and (where the command generates text) --speculative, --draft-model, --prefix-cache-ram and --prefix-cache-disk,
    which reach the command as one EngineConfig argument `config`; ctx_default: what --help says -c defaults to;
    several: -m may be given more than once (the command gets a tuple, empty where none was given);
    prefix_cache_disk: this command's disk tier; distributed: the command takes --distributed (a model split across
    the ranks mlx.launch starts)."""
    if run is None:
        return functools.partial(model_options, ctx_default=ctx_default, several=several, generates=generates,
                                 prefix_cache_disk=prefix_cache_disk, distributed=distributed)

    @functools.wraps(run)
    def command(*args: object, backend: str, weights: str, activations: str | None, kv_memory: str, kv_dtype: str,
                threads: int | None, ctx_size: int | None, speculative: str | None = None,
                draft_model: str | None = None, prefix_cache_ram: str = "0", prefix_cache_disk: str = "0",
                distributed: str | None = None, **kwargs: object) -> object:
        if speculative == "draft" and draft_model is None:
            raise click.UsageError("--speculative draft drafts with the model --draft-model names: give one")
        if distributed and draft_model is not None:
            raise click.UsageError("--draft-model runs beside a model held by one process, not one split across "
                                   "ranks (--distributed); leave one of them out")
        config = EngineConfig(backend=backend, weights=weights, kv_memory=kv_memory, kv_dtype=kv_dtype, threads=threads,
                              max_model_len=ctx_size, activations=activations, speculative=speculative,
                              draft_model=draft_model, prefix_cache_ram=prefix_cache_ram,
                              prefix_cache_disk=prefix_cache_disk, distributed=distributed,
                              remember_step_costs=generates)
        config.prefix_cache_bytes()  # a bad size fails before anything loads
        return run(*args, config=config, **kwargs)

    f = command
    if distributed:
        f = click.option("--distributed", type=click.Choice(DISTRIBUTED_MODES), default=None,
                         help="Split the model across the processes `mlx.launch` starts (this command on every "
                              "rank; rank 0 answers): pipeline gives each rank a stage of layers (any link), tensor "
                              "each layer's heads and MLP columns (a fast link: Thunderbolt). MLX backend only.")(f)
    if generates:
        f = click.option("--prefix-cache-disk", default=prefix_cache_disk, show_default=True, metavar="SIZE",
                         help="Disk under $EDGESERVE_HOME/prefix-cache for the prefix blocks the RAM tier drops, and for "
                              "the pool's when the engine stops: kept across restarts for this model file, KV dtype and "
                              "block size, least recently used out first, shared by every model; 0: off. On for serve "
                              "(agents resend long prompts, and a few GiB hold ~65k tokens of a 1B model's float32 K/V), "
                              "off for one-shot commands.")(f)
        f = click.option("--prefix-cache-ram", default=DEFAULT_PREFIX_CACHE_RAM, show_default=True, metavar="SIZE",
                         help="RAM for the prefix blocks the KV pool evicts, so a prompt continuing one loads its K/V "
                              "instead of computing it again; 0: off. A modest fixed size: it fills only as the pool "
                              "overflows.")(f)
        f = click.option("--draft-model", default=None, metavar="MODEL",
                         help="A smaller model with this model's tokenizer (catalog name, GGUF file or model folder) "
                              "that guesses the next tokens for speculative decoding, all streams' guesses in one "
                              "batch, with its own small KV pool (a quarter of --kv-memory).")(f)
        f = click.option("--speculative", type=click.Choice(SPECULATIVE_MODES), default=None,
                         help="Speculative decoding: ngram guesses the next tokens from the prompt and output so "
                              "far (prompt lookup) and checks them in one step; draft guesses with --draft-model; auto "
                              "does either only as far as it pays, by the measured acceptance and the measured cost of "
                              "a guess (prompt lookup where it finds a match, else the draft model where one is given)  "
                              "[default: auto on the CPU and with --draft-model, else off]")(f)
    f = click.option("--ctx-size", "-c", type=click.IntRange(min=16), default=None,
                     help=f"Context length in tokens  [default: {ctx_default}]")(f)
    f = click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
                     help="CPU threads for the NumPy backend's kernels  [default: every core]")(f)
    f = click.option("--kv-dtype", type=click.Choice(["auto", *KV_DTYPES]), default="auto", show_default=True,
                     help="KV pool element type: float16 holds twice the tokens of float32 in the same --kv-memory, "
                          "int8 (a scale per 64 values of a token's head) about four times; `edgeserve eval kv` "
                          "measures what each costs (pair them with --activations int16 on small models). auto: "
                          "float16 on the CPU (float32 with --weights float32), the activations' dtype on MLX.")(f)
    f = click.option("--kv-memory", default=DEFAULT_KV_MEMORY, show_default=True,
                     help="KV pool size: 2GiB, 512MiB, or a fraction of available memory (0.25, 25%; a container's "
                          "limit counts), whatever the --kv-dtype.")(f)
    f = click.option("--activations", type=click.Choice(list(ACTIVATION_MODES)), default=None,
                     help="NumPy backend's quantized kernels: activations as int8 (llama.cpp's way: fewer "
                          "instructions a weight, 1-2% higher perplexity) or int16 (closest to float32)  "
                          f"[default: EDGESERVE_ACTIVATIONS, else {DEFAULT_ACTIVATIONS}]")(f)
    f = click.option("--weights", type=click.Choice(["auto", *WEIGHT_MODES]), default="auto", show_default=True,
                     help="NumPy backend: compute from the quantized storage (least memory, fastest where "
                          "the C kernels built) or float32 copies (the exact reference); auto picks.")(f)
    f = click.option("--backend", type=BackendChoice(), default="auto", show_default=True,
                     help="Array backend: auto takes MLX on a GPU, NumPy on the CPU.")(f)
    if several:
        return click.option("--model", "-m", "models", multiple=True, metavar="MODEL",
                            help="Catalog name, local GGUF file or model folder, or Hugging Face hub id; repeat it "
                                 f"to serve several (the first is the default)  [default: {DEFAULT_MODEL}]")(f)
    f = click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                     help="Catalog name, local GGUF file or model folder, or Hugging Face hub id.")(f)
    return f


def sampling_options(max_tokens: int) -> Callable[[Callable], Callable]:
    """--max-tokens (with this command's default), --temperature (--temp), --top-p, --top-k, --min-p,
    --repeat-penalty, --repeat-last-n and --seed; they reach the command as one dict `settings` of the
    SamplingParams fields given (checked before anything loads), which the model's SamplingDefaults.apply
    completes."""

    def decorate(run: Callable) -> Callable:
        @functools.wraps(run)
        def command(*args: object, max_tokens: int, temperature: float | None, top_p: float | None,
                    top_k: int | None, min_p: float | None, repeat_penalty: float | None,
                    repeat_last_n: int | None, seed: int | None, **kwargs: object) -> object:
            given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                     "repetition_penalty": repeat_penalty, "repeat_last_n": repeat_last_n, "seed": seed}
            settings = {"max_tokens": max_tokens, **{k: v for k, v in given.items() if v is not None}}
            SamplingParams(**SamplingDefaults().apply(settings))
            return run(*args, settings=settings, **kwargs)

        def fallback(name: str) -> str:
            return f"[default: the model's, else {FALLBACK_SAMPLING[name]}]"

        f = click.option("--seed", type=int, default=None, help="Sampling seed (same seed, same text).")(command)
        f = click.option("--repeat-last-n", type=int, default=None,
                         help=f"Tokens the repeat penalty looks back over; -1: all, 0: off  "
                              f"{fallback('repeat_last_n')}")(f)
        f = click.option("--repeat-penalty", type=float, default=None,
                         help=f"Make tokens seen lately less likely; 1 is off  {fallback('repetition_penalty')}")(f)
        f = click.option("--min-p", type=float, default=None,
                         help=f"Drop tokens less likely than this fraction of the likeliest; 0 is off  "
                              f"{fallback('min_p')}")(f)
        f = click.option("--top-k", type=int, default=None,
                         help=f"Sample from the k likeliest tokens; 0 is off  {fallback('top_k')}")(f)
        f = click.option("--top-p", type=float, default=None, help=f"Nucleus sampling; 1 is off  {fallback('top_p')}")(f)
        f = click.option("--temperature", "--temp", type=float, default=None,
                         help=f"0 is greedy  {fallback('temperature')}")(f)
        return click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=max_tokens,
                            show_default=True, help="Most tokens per answer.")(f)

    return decorate


def join_group(model: str, config: EngineConfig) -> None:
    """With --distributed, on every rank but 0: serve rank 0's steps with this rank's share of the model, then exit
    (rank 0 returns, and runs the command)."""
    if not config.distributed:
        return
    from edgeserve.distributed.group import world

    group = world()
    if group.rank == 0:
        return
    from edgeserve.distributed.runner import serve_rank
    from edgeserve.models.loader import load_model

    serve_rank(load_model(model), group)
    sys.exit(0)


def build_engine(model: str, config: EngineConfig, quiet: bool = False) -> LLMEngine:
    """Load the model and start an engine, printing what was allocated to stderr.

    On a terminal a note that loading has begun comes first, before the engine's modules (NumPy, the
    kernels, MLX) are imported, so the command answers at once however long they take.
    """
    if not quiet and sys.stderr.isatty():
        print(f"loading {model}…", file=sys.stderr, flush=True)
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.models.loader import load_model

    loaded = load_model(model)
    engine = LLMEngine(loaded, config)
    if not quiet:
        print(f"{loaded.source.name} on {engine.backend.describe()}; {engine.pool_size.describe()}", file=sys.stderr)
        if config.distributed:
            print(engine.runner.describe(), file=sys.stderr)
        if engine.drafter is not None:
            print(f"draft model {engine.drafter.model.source.name}; its {engine.drafter.pool_size.describe()}",
                  file=sys.stderr)
        # the KV pool capping the model's own context is the expected case; a --ctx-size it cannot hold is news
        if config.max_model_len is not None and (note := engine.describe_limits()) is not None:
            print(note, file=sys.stderr)
    return engine
