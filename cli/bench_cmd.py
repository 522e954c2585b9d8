"""`edgeserve bench`: seeded workloads against the in-process engine or any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from edgeserve.cli.options import model_options
from edgeserve.config import EngineConfig

if TYPE_CHECKING:
    from edgeserve.text.tokenizer import Tokenizer

WORKLOADS = ("single", "mixed", "sweep", "prefix", "speculative", "all")
SWEEP = "1,4,8,16,32,64"
SWEEP_TOKENS = 128  # prompt and output tokens of a sweep stream, as llama-batched-bench -npp 128 -ntg 128


# words in figure names, as a table shows them
WORDS = {"ttft": "TTFT", "tpot": "time per output token", "kv": "KV", "wall": "wall time", "over": "/"}


# speeds whose name alone does not say what they measure
SPEEDS = {"output_tokens_per_s": "output tokens/s (over the wall time)",
          "decode_tokens_per_s": "decode tokens/s (after the first token)",
          "prefill_tokens_per_s": "prefill tokens/s (prompt over TTFT, after a warm-up prompt)",
          "decode_empty_context_tokens_per_s": "decode tokens/s from an empty context"}


def figure_label(key: str, value: object) -> tuple[str, str]:
    """A figure's name and value as a table shows them: seconds in ms, fractions in %, per_s as /s."""

    def words(name: str) -> str:
        return " ".join(WORDS.get(w, w) for w in name.split("_"))

    if key in SPEEDS:
        return SPEEDS[key], str(value)
    if key.endswith("_per_s"):
        return f"{words(key.removesuffix('_per_s'))}/s", str(value)
    if key.endswith("_s") and isinstance(value, (int, float)):
        return f"{words(key.removesuffix('_s'))} (ms)", f"{value * 1000:.1f}"
    if isinstance(value, float) and ("utilization" in key or key.endswith("rate")):
        return words(key), f"{100 * value:.1f}%"
    return words(key), str(value)


def _print_table(title: str, runs: list[dict]) -> None:
    """One column per run, headed by its name, one row per figure."""
    table = Table(title=title)
    table.add_column("figure")
    for run in runs:
        table.add_column(str(run.get("name", "")), justify="right")
    for key in dict.fromkeys(k for run in runs for k in run if k != "name"):
        cells = [figure_label(key, run[key]) if key in run else (None, "") for run in runs]
        label = next(name for name, _ in cells if name is not None)
        table.add_row(label, *(text for _, text in cells))
    Console(stderr=True).print(table)


@click.command("bench")
@model_options
@click.option("--workload", "-w", type=click.Choice(WORKLOADS), default="all", show_default=True,
              help="single: one stream (prefill, decode); mixed: 64 varied requests, continuous vs static; "
                   "sweep: decode at 1-64 streams; prefix: 16 requests sharing a 1,500-token system prompt; "
                   "speculative (not in all): tasks that copy their input and an open chat, one stream and then 64 "
                   "requests 16 at a time, with speculative decoding off, auto and ngram, and draft with "
                   "--draft-model.")
@click.option("--max-batch", default=16, show_default=True, help="Max running sequences (both batching modes).")
@click.option("--requests", "num_requests", default=64, show_default=True, help="Requests in the mixed workload.")
@click.option("--max-output", default=512, show_default=True, help="Longest output in the mixed workload.")
@click.option("--streams", default=SWEEP, show_default=True,
              help="Concurrent stream counts of the sweep, comma-separated.")
@click.option("--context", type=click.IntRange(min=SWEEP_TOKENS), default=SWEEP_TOKENS, show_default=True,
              help=f"Tokens each sweep stream holds when it starts decoding: past {SWEEP_TOKENS}, a shared prefix "
                   f"computed once (then read from the prefix cache) and {SWEEP_TOKENS} of its own, so each step reads "
                   f"that much K/V per stream.")
@click.option("--seed", default=0, show_default=True)
@click.option("--url", default=None, help="Benchmark this OpenAI-compatible server instead of the in-process engine.")
@click.option("--concurrency", default=16, show_default=True, help="Concurrent clients with --url.")
@click.option("--api-key", default=None, help="API key for --url.")
@click.option("--served-model", default=None, help="Model name to send with --url (default: the server's first).")
@click.option("--profile", is_flag=True,
              help="Add where each engine step's time goes (single and sweep): scheduling, batch building, graph "
                   "building, evaluation, sampling, output (stop checks, detokenizing), idle, and host time in all.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON on stdout.")
def bench_cmd(model: str, config: EngineConfig, workload: str, max_batch: int,
              num_requests: int, max_output: int, streams: str, context: int, seed: int, url: str | None, concurrency: int,
              api_key: str | None,
              served_model: str | None, profile: bool, as_json: bool) -> None:
    """Measure throughput, TTFT, time per output token, KV use and prefix-cache hits."""
    # the workloads and the engine import NumPy and the kernels: loaded when a benchmark runs, not for --help
    from edgeserve.bench import workloads
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.models.loader import load_model

    if url and workload == "speculative":
        raise click.UsageError("the speculative workload compares the in-process engine's modes; leave out --url")
    if url and context > SWEEP_TOKENS:
        raise click.UsageError("--context shapes the in-process sweep; leave out --url")
    if url and profile:
        raise click.UsageError("--profile times the in-process engine's steps; leave out --url")
    loaded = load_model(model)
    tok = loaded.tokenizer
    results: dict[str, object] = {"model": loaded.source.name}
    if url:
        results["url"] = url
        results.update(_bench_server(url, workload, tok, num_requests, max_output, streams, seed, concurrency,
                                     api_key, served_model))
        _emit(results, as_json)
        return

    # each workload on a fresh engine, so none starts with another's prefix cache
    # the draft model loaded once, for every engine
    draft = load_model(config.draft_model) if config.draft_model else None
    # each figure from what its own run measures, not from what earlier runs taught
    config = dataclasses.replace(config, max_num_seqs=max_batch, draft_model=None, remember_step_costs=False)
    backend = LLMEngine(loaded, config, draft).backend
    results["backend"], results["runs_on"] = backend.name, backend.describe()
    # each workload's KV pool mapped in before it starts, as a server's is (else the first touch of each of its pages,
    # 2 MiB zeroed a fault, lands in the steps timed: ~2% of a 64-stream sweep's samples on a 1B model)
    config = dataclasses.replace(config, populate_kv=True)
    print(f"{loaded.source.name} on {results['runs_on']}", file=sys.stderr)
    if workload in ("single", "all"):
        req = workloads.uniform_workload(tok, 1, 512, 128, seed)
        engine = LLMEngine(loaded, config, draft)
        # llama-bench times after a warm-up run: so here, or the prefill figure would hold first-use costs (the
        # weights' pages read in, the pool's memory touched) that a running server paid once
        workloads.run_engine(engine, workloads.uniform_workload(tok, 1, 512, 1, seed + 1), "warm-up")
        r = workloads.run_engine(engine, req, "single stream", profile=profile).summary()
        r["prefill_tokens_per_s"] = round(512 / r["ttft_p50_s"], 1)
        # llama-bench's tg128 decodes from an empty context: a one-token prompt here is the same work, on an engine
        # warmed up as above (a fresh engine's first answer decoded 3-7% slower on a 1B model)
        req = workloads.uniform_workload(tok, 1, 1, 128, seed)
        engine = LLMEngine(loaded, config, draft)
        workloads.run_engine(engine, workloads.uniform_workload(tok, 1, 1, 16, seed + 1), "warm-up")
        empty = workloads.run_engine(engine, req, "single stream, empty context").summary()
        r["decode_empty_context_tokens_per_s"] = empty["decode_tokens_per_s"]
        results["single"] = r
    if workload in ("mixed", "all"):
        requests = workloads.mixed_workload(tok, num_requests, seed, max_output=max_output)
        cont = workloads.run_engine(LLMEngine(loaded, config, draft), requests, "continuous").summary()
        static_engine = LLMEngine(loaded, config, draft, static_batching=True)
        static = workloads.run_engine(static_engine, requests, "static").summary()
        ratio = round(cont["output_tokens_per_s"] / static["output_tokens_per_s"], 2)
        results["mixed"] = {"continuous": cont, "static": static, "continuous_over_static": ratio}
    if workload in ("sweep", "all"):
        rows = []
        for n in _stream_counts(streams):
            e = LLMEngine(loaded, config, draft, max_num_seqs=max(n, max_batch), max_num_batched_tokens=max(512, n))
            if context > SWEEP_TOKENS:
                requests = workloads.shared_prefix_workload(tok, n, context - SWEEP_TOKENS, SWEEP_TOKENS, SWEEP_TOKENS,
                                                            seed)
                workloads.run_engine(e, [dataclasses.replace(requests[0], max_tokens=1)], "shared prefix")
            else:
                requests = workloads.uniform_workload(tok, n, SWEEP_TOKENS, SWEEP_TOKENS, seed)
            r = workloads.run_engine(e, requests, f"{n} stream{'s' if n > 1 else ''}", profile=profile).summary()
            rows.append({"streams": n, "context": context, "decode_tokens_per_s": r["decode_tokens_per_s"],
                         "output_tokens_per_s": r["output_tokens_per_s"], "tpot_p50_s": r["tpot_p50_s"],
                         **{k: v for k, v in r.items() if k.startswith("step_")}})
        results["sweep"] = rows
    if workload in ("prefix", "all"):
        requests = workloads.shared_prefix_workload(tok, 16, 1500, seed=seed)
        results["prefix"] = workloads.run_shared_prefix(LLMEngine(loaded, config, draft), requests)
    if workload == "speculative":
        modes = ("off", "auto", "ngram") + (("draft",) if draft else ())

        def make_engine(mode: str, max_num_seqs: int = max_batch) -> LLMEngine:
            return workloads.pool_mapped(LLMEngine(loaded, config, draft if mode in ("auto", "draft") else None,
                                                   speculative=mode, max_num_seqs=max_num_seqs))

        results["speculative"] = workloads.run_speculative(make_engine, modes)
        streams = 16
        results["speculative_batch"] = workloads.run_speculative_batch(lambda mode: make_engine(mode, streams),
                                                                       streams, modes=modes)
    _emit(results, as_json)


def _bench_server(url: str, workload: str, tok: Tokenizer, num_requests: int, max_output: int, streams: str,
                  seed: int, concurrency: int, api_key: str | None, model: str | None) -> dict:
    """The chosen workloads, sent to a server as streaming completions."""
    import numpy as np

    from edgeserve.bench import workloads
    from edgeserve.bench.http_driver import run_http_bench

    def send(requests: list[workloads.BenchRequest], clients: int) -> workloads.BenchResult:
        return asyncio.run(run_http_bench(url, requests, clients, model, api_key=api_key))

    results: dict[str, object] = {}
    if workload in ("single", "all"):
        r = send(workloads.uniform_workload(tok, 1, 512, 128, seed), 1).summary()
        r["prefill_tokens_per_s"] = round(512 / r["ttft_p50_s"], 1)
        results["single"] = r
    if workload in ("mixed", "all"):
        requests = workloads.mixed_workload(tok, num_requests, seed, max_prompt=256, max_output=min(max_output, 128))
        results["mixed"] = send(requests, concurrency).summary()
    if workload in ("sweep", "all"):
        rows = []
        for n in _stream_counts(streams):
            r = send(workloads.uniform_workload(tok, n, SWEEP_TOKENS, SWEEP_TOKENS, seed), n).summary()
            rows.append({"streams": n, "output_tokens_per_s": r["output_tokens_per_s"], "tpot_p50_s": r["tpot_p50_s"]})
        results["sweep"] = rows
    if workload in ("prefix", "all"):
        # one at a time: the first finds the shared prompt cold, the rest in the server's prefix cache
        timings = send(workloads.shared_prefix_workload(tok, 16, 1500, seed=seed), 1).timings
        cold, hit = timings[0].ttft, float(np.median([t.ttft for t in timings[1:]]))
        results["prefix"] = {"requests": len(timings), "cold_ttft_s": round(cold, 4), "hit_ttft_p50_s": round(hit, 4),
                             "cold_over_hit_ttft": round(cold / hit, 1)}
    return results


def _stream_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of stream counts", param_hint="--streams")
    return counts


def _emit(results: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(results, indent=1))
        return
    for key, value in results.items():
        if key == "mixed" and "continuous" in value:
            _print_table("mixed workload: continuous vs static batching",
                         [value["continuous"], value["static"]])
            click.echo(f"continuous / static throughput: {value['continuous_over_static']}x", err=True)
        elif key == "sweep":
            _print_table("decode throughput by concurrent streams", value)
        elif key == "speculative":
            _print_table("speculative decoding, one stream, greedy", value)
        elif key == "speculative_batch":
            _print_table("speculative decoding, 64 requests 16 at a time, greedy", value)
        elif isinstance(value, dict):
            _print_table(key, [value])
