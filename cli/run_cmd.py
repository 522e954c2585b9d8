"""`edgeserve run`: a one-shot answer to a prompt, streamed."""

from __future__ import annotations

import json
import sys
import time

import click

from edgeserve.cli.options import build_engine, model_options
from edgeserve.config import EngineConfig
from edgeserve.sampling_params import SamplingParams


@click.command()
@model_options
@click.option("--max-tokens", "-n", default=256, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", "-t", default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampling (same seed, same text).")
@click.option("--system", default=None, help="System prompt (chat models).")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and timings.")
@click.argument("prompt")
def run(model: str, config: EngineConfig, max_tokens: int, temperature: float, top_p: float,
        seed: int | None, system: str | None, raw: bool, as_json: bool, prompt: str) -> None:
    """Answer PROMPT once and exit."""
    engine = build_engine(model, config, quiet=as_json)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    if raw or engine.tokenizer.chat_template is None and system is None:
        ids = engine.tokenize_prompt(prompt)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = engine.chat_prompt_ids(messages)
    start = time.perf_counter()
    rid = engine.add_request(ids, params)
    text, n_out, ttft, reason = "", 0, None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            text += out.text
            n_out, ttft, reason = out.num_output_tokens, out.ttft, out.finish_reason
            if not as_json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    elapsed = time.perf_counter() - start
    decode_tps = (n_out - 1) / (elapsed - ttft) if ttft is not None and n_out > 1 and elapsed > ttft else 0.0
    if as_json:
        click.echo(json.dumps({
            "model": engine.model.source.name, "backend": engine.backend.name,
            "runs_on": engine.backend.describe(), "text": text,
            "prompt_tokens": len(ids), "completion_tokens": n_out, "finish_reason": reason,
            "ttft_s": round(ttft or 0.0, 4), "decode_tokens_per_s": round(decode_tps, 2),
            "total_s": round(elapsed, 4),
        }))
    else:
        click.echo()
        click.secho(f"[{len(ids)} prompt + {n_out} tokens, TTFT {ttft or 0:.2f}s, {decode_tps:.1f} tok/s]",
                    dim=True, err=True)
