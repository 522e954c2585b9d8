"""Our MLX path against mlx-lm: one MLX folder, one device, the same activation dtype, greedy, one sitting.

One stream runs mlx-lm's `stream_generate` against one request in our engine; more streams run mlx-lm's
`BatchGenerator` against that many requests at once in ours. Every prompt is prefilled in one step on
both sides, and each stream count is warmed up first with a few tokens of other prompts, so first-use
costs (kernel compiles, allocations) stay out of the figures.

- Decode tokens/s, for both: the tokens produced from the step at which every stream has its first
  token to the last token, over that wall time (all streams start and end together).
- Host ms per decode step: the step's wall time minus the time blocked on the device. Ours comes from
  the engine's step profile (every phase but `eval`); mlx-lm's from timing where its loops wait on the
  device (see DeviceWaits).

mlx-lm's model is cast to the dtype our backend computes in (float16 on a GPU, float32 on the CPU,
where MLX's half-precision ops are slow); random-weight folders come from bench/make_random_mlx.py.

    python bench/compare_mlx_lm.py --model smollm2-135m-random-4bit --streams 1,8,32 --tokens 128
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import click
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from rich.console import Console
from rich.table import Table

from edgeserve.bench.workloads import random_prompts
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.loader import load_model
from edgeserve.sampling_params import SamplingParams

WARMUP_TOKENS = 4
AGREE_TOKENS = 16  # stream 0's first greedy tokens compared between the engines


class DeviceWaits:
    """Stands in for `mlx.core` inside `mlx_lm.generate`, adding up the seconds its loops spend in MLX's evaluation.

    That is what our profile's `eval` phase holds (MLX scheduling the graph and waiting for the device),
    so host time is the rest of a step on both sides. mlx-lm pipelines its steps: it queues step n+1
    (`mx.async_eval`, which on the CPU itself waits while too much work is in flight) and then blocks
    until step n's tokens are ready (`y.item()` in `generate_step`, `mx.eval` in `BatchGenerator`). A
    method of an array cannot be wrapped, so that wait moves here: after queueing a step, wait for what
    was queued before it, which the loop reads next anyway (the order of work is unchanged and `.item()`
    then returns at once).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._queued: tuple[Any, ...] = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def eval(self, *arrays: Any) -> None:
        start = time.perf_counter()
        mx.eval(*arrays)
        self.seconds += time.perf_counter() - start

    def async_eval(self, *arrays: Any) -> None:
        start = time.perf_counter()
        mx.async_eval(*arrays)
        mx.eval(*self._queued)
        self.seconds += time.perf_counter() - start
        self._queued = arrays


@contextmanager
def device_waits() -> Iterator[DeviceWaits]:
    """mlx-lm's generation loops, timed where they wait on the device, while the block runs."""
    waits = DeviceWaits()
    # mlx_lm.generate is also the name of a function in mlx_lm, which `import mlx_lm.generate` would give
    with mock.patch.object(importlib.import_module("mlx_lm.generate"), "mx", waits):
        yield waits


@dataclass
class Figures:
    """One engine at one stream count, over the decode window."""

    tokens_per_s: float
    host_ms_per_step: float
    steps: int


class DecodeWindow:
    """Counts what each step produced; the window opens at the step that gives the last stream its first token. A
    call may bring several decode steps' tokens (our engine's bursts): it counts as the most any stream got."""

    def __init__(self, streams: Sequence[Any]) -> None:
        self.counts = dict.fromkeys(streams, 0)
        self.first = streams[0]
        self.stream0: list[int] = []  # stream 0's tokens, the first one included
        self.start: float | None = None
        self.end = 0.0
        self.tokens = 0
        self.steps = 0

    def step(self, produced: list[tuple[Any, list[int]]]) -> bool:
        """Record one step's (stream, new tokens); True when this step opened the window."""
        for stream, tokens in produced:
            self.counts[stream] += len(tokens)
            if stream == self.first:
                self.stream0.extend(tokens)
        self.end = time.perf_counter()
        if self.start is not None:
            self.tokens += sum(len(tokens) for _, tokens in produced)
            self.steps += max((len(tokens) for _, tokens in produced), default=0)
            return False
        if all(self.counts.values()):
            self.start = self.end
            return True
        return False

    @property
    def wall(self) -> float:
        return self.end - self.start if self.start is not None else 0.0

    def figures(self, host_ms_per_step: float) -> Figures:
        return Figures(self.tokens / self.wall if self.wall else 0.0, host_ms_per_step, self.steps)


Run = tuple[Figures, list[int]]  # and stream 0's tokens


def mlx_lm_one(model: nn.Module, tokenizer: TokenizerWrapper, prompt: list[int], tokens: int) -> Run:
    """One stream through mlx_lm.stream_generate."""
    window = DecodeWindow([0])
    with device_waits() as waits:
        for response in stream_generate(model, tokenizer, prompt, max_tokens=tokens, sampler=greedy_sampler):
            if window.step([(0, [response.token])]):
                waits.seconds = 0.0
            waited = waits.seconds  # not what the generator waits for after its last token
    return window.figures(1000 * (window.wall - waited) / max(window.steps, 1)), window.stream0


def mlx_lm_batched(model: nn.Module, prompts: list[list[int]], tokens: int) -> Run:
    """Every prompt at once through mlx-lm's BatchGenerator, prefilled in one batch."""
    n = len(prompts)
    generator = BatchGenerator(model, max_tokens=tokens, sampler=greedy_sampler, completion_batch_size=n,
                               prefill_batch_size=n)
    try:
        window = DecodeWindow(generator.insert(prompts))
        with device_waits() as waits:
            while sum(window.counts.values()) < n * tokens:
                _, responses = generator.next()
                if window.step([(r.uid, [r.token]) for r in responses]):
                    waits.seconds = 0.0
            waited = waits.seconds
    finally:
        generator.close()
    return window.figures(1000 * (window.wall - waited) / max(window.steps, 1)), window.stream0


def mlx_lm_run(model: nn.Module, tokenizer: TokenizerWrapper, prompts: list[list[int]], tokens: int) -> Run:
    """stream_generate for one stream, BatchGenerator for more."""
    if len(prompts) == 1:
        return mlx_lm_one(model, tokenizer, prompts[0], tokens)
    return mlx_lm_batched(model, prompts, tokens)


def ours_run(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> Run:
    """Every prompt as a request at once, stepping the engine until all finish."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    window = DecodeWindow([engine.add_request(p, params) for p in prompts])
    while engine.has_unfinished():
        if window.step([(out.request_id, out.token_ids) for out in engine.step()]):
            engine.profile.reset()
    return window.figures(1000 * engine.profile.summary()["host_s"]), window.stream0


def leading_agreement(a: list[int], b: list[int], n: int = AGREE_TOKENS) -> int:
    """How many of the first n tokens agree before the first difference."""
    same = 0
    for x, y in zip(a[:n], b[:n]):
        if x != y:
            break
        same += 1
    return same


def device_name() -> str:
    """MLX's default device, the hardware under it, and whether MLX sees a CUDA GPU."""
    hardware = mx.device_info().get("device_name", "unknown")
    return f"{mx.default_device()}, {hardware}, {'CUDA' if mx.cuda.is_available() else 'no CUDA'}"


def compare(folder: Path, streams: list[int], tokens: int, prompt_tokens: int,
            status: Callable[[str], None] = lambda _: None) -> dict:
    """Both engines at each stream count, a warm-up then the timed run; the figures as a dictionary."""
    model = load_model(str(folder))
    # every prompt prefilled in one step, as mlx-lm's BatchGenerator is asked to
    engine = LLMEngine(model, backend="mlx", max_num_seqs=max(streams),
                       max_num_batched_tokens=max(512, max(streams) * prompt_tokens))
    theirs, tokenizer = mlx_lm_load(str(folder))
    theirs.set_dtype(engine.backend.dtype)
    tokenizer.eos_token_ids = set()  # as ignore_eos: every stream runs its full length
    engines: dict[str, Callable[[list[list[int]], int], Run]] = {
        "mlx_lm": partial(mlx_lm_run, theirs, tokenizer), "ours": partial(ours_run, engine)}
    rng = np.random.default_rng(0)
    rows = []
    try:
        for n in streams:
            runs = {}
            # the same prompts for both; the warm-up's differ, so our prefix cache cannot skip the timed prefill
            warmup, timed = (random_prompts(model.tokenizer, [prompt_tokens] * n, rng) for _ in range(2))
            for name, run in engines.items():
                status(f"{name}: {n} stream{'s' * (n > 1)}")
                run(warmup, WARMUP_TOKENS)
                runs[name] = run(timed, tokens)
            (theirs_figures, theirs_tokens), (our_figures, our_tokens) = runs["mlx_lm"], runs["ours"]
            rows.append({"streams": n, "mlx_lm": asdict(theirs_figures), "ours": asdict(our_figures),
                         "ratio": (our_figures.tokens_per_s / theirs_figures.tokens_per_s
                                   if theirs_figures.tokens_per_s else None),
                         "greedy_agree": leading_agreement(theirs_tokens, our_tokens),
                         "greedy_compared": min(AGREE_TOKENS, tokens)})
    finally:
        engine.close()
    return {"model": folder.name, "device": device_name(), "dtype": str(engine.backend.dtype).split(".")[-1],
            "prompt_tokens": prompt_tokens, "tokens": tokens, "rows": rows}


def table(results: dict) -> Table:
    """The figures side by side, one row per stream count."""
    out = Table(title=f"{results['model']} on {results['device']}",
                caption=f"{results['dtype']} activations, greedy, {results['prompt_tokens']}-token prompts, "
                        f"{results['tokens']} tokens per stream")
    for name in ("streams", "mlx-lm tok/s", "ours tok/s", "ratio", "mlx-lm host ms", "ours host ms", "agree"):
        out.add_column(name, justify="right")
    for row in results["rows"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        out.add_row(str(row["streams"]), f"{row['mlx_lm']['tokens_per_s']:.1f}", f"{row['ours']['tokens_per_s']:.1f}",
                    ratio, f"{row['mlx_lm']['host_ms_per_step']:.2f}", f"{row['ours']['host_ms_per_step']:.2f}",
                    f"{row['greedy_agree']}/{row['greedy_compared']}")
    return out


def parse_streams(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    try:
        streams = [int(s) for s in value.split(",")]
    except ValueError:
        streams = []
    if not streams or min(streams) < 1:
        raise click.BadParameter(f"{value!r}: positive stream counts separated by commas, e.g. 1,8,32")
    return streams


@click.command()
@click.option("--model", "folder", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="An MLX-format folder (edgeserve convert, bench/make_random_mlx.py or mlx-lm's own).")
@click.option("--streams", default="1,8,32", show_default=True, callback=parse_streams,
              help="Stream counts: 1 runs stream_generate, more run BatchGenerator.")
@click.option("--tokens", type=click.IntRange(2), default=128, show_default=True, help="Tokens per stream.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def main(folder: Path, streams: list[int], tokens: int, prompt_tokens: int, as_json: bool) -> None:
    """Decode tokens/s and host time per step of our MLX path and mlx-lm, side by side."""
    console = Console(stderr=True)
    with console.status("loading") as spinner:
        results = compare(folder, streams, tokens, prompt_tokens, lambda text: spinner.update(text))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    out = Console()
    out.print(table(results))
    out.print("tok/s: the tokens after every stream has its first, over that wall time. host ms: per decode step, "
              "its wall time less its time in MLX's evaluation (scheduling the graph, waiting on the device). "
              "agree: stream 0's leading greedy tokens that match (float reductions differ).")


if __name__ == "__main__":
    main()
