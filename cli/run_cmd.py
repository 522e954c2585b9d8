"""`edgeserve run`: a one-shot answer to a prompt, streamed."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, TextIO

import click

from edgeserve.cli.options import build_engine, join_group, model_options, sampling_options
from edgeserve.config import EngineConfig
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import CATALOG
from edgeserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from edgeserve.engine.llm_engine import LLMEngine


def read_prompt(prompt: str | None, prompt_option: str | None, prompt_file: TextIO | None) -> str:
    """The one prompt given as PROMPT, -p or -f; '-' or nothing with piped input reads stdin."""
    given = [p for p in (prompt, prompt_option) if p is not None]
    if len(given) + (prompt_file is not None) > 1:
        raise click.UsageError("give the prompt once: PROMPT, -p TEXT or -f FILE")
    if prompt_file is None and (given == ["-"] or not given and not sys.stdin.isatty()):
        prompt_file = sys.stdin
    if prompt_file is not None:
        try:
            text = prompt_file.read()
        except UnicodeDecodeError as exc:
            raise EdgeserveError(f"{prompt_file.name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    elif given:
        text = given[0]
    else:
        raise click.UsageError("no prompt: give PROMPT, -p TEXT or -f FILE, or pipe it in")
    if not text.strip():
        raise click.UsageError("the prompt is empty")
    return text


def is_base_model(model: str, chat_template: str | None) -> bool:
    """Whether the model continues text rather than chats: it has no chat template, or the catalog says base."""
    return chat_template is None or model in CATALOG and CATALOG[model].base


def read_schema(schema_file: TextIO) -> dict:
    """The JSON Schema in --json-schema's file (its grammar is checked when the request is added)."""
    try:
        schema = json.load(schema_file)
    except ValueError as exc:
        raise click.BadParameter(f"{schema_file.name} is not JSON: {exc}", param_hint="--json-schema") from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{schema_file.name} holds no JSON object", param_hint="--json-schema")
    return schema


@click.command()
@model_options(distributed=True)
@sampling_options(max_tokens=256)
@click.option("--prompt", "-p", "prompt_option", default=None, help="The prompt, instead of PROMPT.")
@click.option("--file", "-f", "prompt_file", type=click.File(encoding="utf-8"), default=None,
              help="Read the prompt from this file ('-': stdin).")
@click.option("--system", default=None, help="System prompt (chat models).")
@click.option("--raw/--chat", default=None,
              help="Send the prompt as is, or through the model's chat template  "
                   "[default: raw for base models, the template otherwise]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and timings.")
@click.option("--json-schema", "schema_file", type=click.File(encoding="utf-8"), default=None,
              help="Answer with JSON that follows the JSON Schema in this file.")
@click.argument("prompt", required=False)
def run(model: str, config: EngineConfig, settings: dict, prompt_option: str | None, prompt_file: TextIO | None,
        system: str | None, raw: bool | None, as_json: bool, schema_file: TextIO | None, prompt: str | None) -> None:
    """Answer PROMPT once and exit.

    The prompt comes from PROMPT, -p TEXT or -f FILE; with none of them (or '-'), from stdin:
    `echo hi | edgeserve run`.
    """
    join_group(model, config)  # ranks but 0 serve rank 0's steps here (the prompt is rank 0's)
    prompt = read_prompt(prompt, prompt_option, prompt_file)
    schema = read_schema(schema_file) if schema_file is not None else None
    engine = build_engine(model, config, quiet=as_json)
    params = SamplingParams(**engine.model.sampling_defaults.apply(settings), json_schema=schema)
    if raw is None:
        raw = is_base_model(model, engine.tokenizer.chat_template) and system is None
        if raw and not as_json:
            print(f"{model} is a base model: the prompt goes in as is, to be continued (--chat applies the "
                  f"chat template)", file=sys.stderr)
    if raw:
        ids = engine.tokenize_prompt(prompt)
    else:
        from edgeserve.engine.prompts import Prompts  # loaded with the engine, not before the command runs

        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = Prompts.for_engine(engine).chat(messages)
    from edgeserve.cli.feedback import PromptSpinner, stderr_console, stop_note  # rich: not needed for --help

    console = stderr_console()
    start = time.perf_counter()
    rid = engine.add_request(ids, params)
    text, n_out, ttft, reason = "", 0, None, None
    with PromptSpinner(console, len(ids), show=not as_json) as spinner:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                spinner.stop()
                text += out.text
                n_out, ttft, reason = out.num_output_tokens, out.ttft, out.finish_reason
                if not as_json:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
    elapsed = time.perf_counter() - start
    engine.close()  # with --prefix-cache-disk, the prompt's blocks are kept for the next run
    decode_tps = (n_out - 1) / (elapsed - ttft) if ttft is not None and n_out > 1 and elapsed > ttft else 0.0
    if as_json:
        click.echo(json.dumps({
            "model": engine.model.source.name, "backend": engine.backend.name,
            "runs_on": engine.backend.describe(), "text": text,
            "prompt_tokens": len(ids), "completion_tokens": n_out, "finish_reason": reason,
            "ttft_s": round(ttft or 0.0, 4), "decode_tokens_per_s": round(decode_tps, 2),
            "total_s": round(elapsed, 4),
            **_speculation(engine),
        }))
    else:
        click.echo()
        stop = stop_note(reason, n_out, params.max_tokens)
        console.print(f"[{len(ids)} prompt + {n_out} tokens, TTFT {ttft or 0:.2f}s, {decode_tps:.1f} tok/s"
                      f"{'' if stop is None else ' · ' + stop}]", style="dim", markup=False)


def _speculation(engine: LLMEngine) -> dict:
    """The speculative decoding figures, where the request guessed any tokens."""
    st = engine.stats()
    if not st.draft_tokens:
        return {}
    return {"draft_tokens": st.draft_tokens, "accepted_draft_tokens": st.accepted_draft_tokens,
            "draft_acceptance_rate": round(st.draft_acceptance_rate, 4)}
