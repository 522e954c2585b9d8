"""Small cuts a new user met: ps --json errors, the capped-context note, eval perplexity's -c default,
image content parts, and bench's single-stream table."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from loopback import ServerThread
from model_folder import write_model_folder
from edgeserve.cli.bench_cmd import SPEEDS, _emit
from edgeserve.cli.main import cli
from edgeserve.config import EngineConfig
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.server.app import create_app


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_ps_json_reports_errors_as_json():
    result = invoke("ps", "--url", "http://127.0.0.1:9", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error"]["message"].startswith("no server answers")


@pytest.fixture
def folder(tiny_model, tmp_path: Path) -> Path:
    out = tmp_path / "tiny"
    write_model_folder(tiny_model, out)
    return out


def test_the_capped_context_note_only_when_more_was_asked_than_fits(folder):
    # 1 MiB of KV holds half the tiny model's 4096-token context
    common = ["run", "-m", str(folder), "--backend", "numpy", "--kv-memory", "1MiB", "-n", "2", "--raw", "hi"]
    assert "capped" not in invoke(*common).stderr
    assert "capped" in invoke(*common, "-c", "4096").stderr


def test_eval_perplexity_help_and_text_agree_on_the_window():
    text = " ".join(invoke("eval", "perplexity", "--help").stdout.split())
    assert "[default: 512]" in text and "the model's" not in text


@pytest.fixture(scope="module")
def server_url(tiny_model):
    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    server = ServerThread(create_app(aengine, "tiny"))
    yield server.url
    server.stop()
    aengine.shutdown()


def test_an_image_part_is_refused_as_text_only(server_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    answer = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message.startswith("invalid request: messages.0.content.1.type: this model reads text only: "
                              "a content part of type 'image_url' cannot be read")


def test_bench_single_names_its_column_and_each_speed(capsys):
    run = {"name": "single stream", "requests": 1, "output_tokens_per_s": 10.0, "decode_tokens_per_s": 11.0,
           "prefill_tokens_per_s": 500.0, "decode_empty_context_tokens_per_s": 12.0}
    _emit({"single": run}, as_json=False)
    table = capsys.readouterr().err
    header = next(line for line in table.splitlines() if "figure" in line)
    assert "single stream" in header
    assert all(label in table for label in SPEEDS.values())
