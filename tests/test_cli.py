"""The command line as users bring their habits to it: prompt sources and shared flags, the prompt spinner,
`info -m`, `serve --alias`, `ps`, `models`/`rm` with converted folders, and `bench` progress and tables."""

import json
import re
import subprocess
import sys
import threading

import click
import openai
import pexpect
import pytest
from click.testing import CliRunner

from edgeserve.cli.convert_cmd import report_notice
from edgeserve.cli.main import cli
from edgeserve.evaluation.perplexity import windows
from edgeserve.evaluation.quality_report import REPORT_CTX, SHIPPED_TEXT

CLI = [sys.executable, "-c", "from edgeserve.cli.main import cli; cli()"]
TIMEOUT = 180
ENGINE = ["--backend", "numpy", "--kv-memory", "64MiB"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input)


# flags -----------------------------------------------------------------------------------


def test_help_shows_every_default():
    ctx = click.Context(cli)
    missing = []
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        subcommands = command.commands.values() if isinstance(command, click.Group) else [command]
        for sub in subcommands:
            sub_ctx = click.Context(sub, parent=ctx, info_name=sub.name)
            for param in sub.params:
                if not isinstance(param, click.Option) or param.is_flag or param.multiple or param.required \
                        or param.default is None or param.hidden:
                    continue
                if "default:" not in param.get_help_record(sub_ctx)[1]:
                    missing.append(f"{name} {sub.name} {param.opts[0]}")
    assert missing == []
    assert "-h, --help" in invoke("run", "-h").output


def test_the_prompt_comes_from_an_argument_p_f_or_stdin(model_path, tmp_path):
    prompt = "Name a colour."
    (tmp_path / "prompt.txt").write_text(prompt)
    common = ["run", "--model", str(model_path), *ENGINE, "--temp", "0", "-n", "6", "--json"]
    answers = {}
    for how, args, stdin in [("argument", [prompt], None), ("-p", ["-p", prompt], None),
                             ("-f", ["-f", str(tmp_path / "prompt.txt")], None), ("-", ["-"], prompt),
                             ("piped", [], prompt)]:
        result = invoke(*common, *args, input=stdin)
        assert result.exit_code == 0, (how, result.output)
        answers[how] = json.loads(result.stdout)

    assert len({a["text"] for a in answers.values()}) == 1  # the same prompt, whichever way it came
    assert len({a["prompt_tokens"] for a in answers.values()}) == 1
    assert answers["argument"]["completion_tokens"] == 6


@pytest.mark.parametrize("args, stdin, message", [
    (["hi", "-p", "there"], None, "give the prompt once"),
    (["-"], "   \n", "the prompt is empty"),
    (["--temp", "3", "hi"], None, "temperature must be between 0 and 2"),
    (["--top-k", "-1", "hi"], None, "top_k must be 0"),
])
def test_bad_prompts_and_settings_are_one_line_of_error(args, stdin, message):
    result = invoke("run", *ENGINE, *args, input=stdin)
    assert result.exit_code != 0
    assert message in result.stderr and "Traceback" not in result.stderr


def test_dash_t_is_threads_and_c_the_context(model_path):
    result = invoke("run", "--model", str(model_path), *ENGINE, "-t", "1", "-c", "64", "-n", "2", "--json", "hi")
    assert result.exit_code == 0, result.output
    assert "1 thread" in json.loads(result.stdout)["runs_on"]
    too_long = invoke("run", "--model", str(model_path), *ENGINE, "-c", "64", "-n", "2", "word " * 100)
    assert too_long.exit_code == 1 and "64" in too_long.stderr


def test_run_shows_a_spinner_until_the_first_token(model_path):
    child = pexpect.spawn(CLI[0], [*CLI[1:], "run", "--model", str(model_path), *ENGINE, "--temp", "0", "-n", "8",
                                   "-p", "Tell me about the moon."], encoding="utf-8", timeout=TIMEOUT,
                          dimensions=(24, 80))
    child.expect(r"processing prompt \((\d+) tokens\)…")
    spinner_tokens = int(child.match.group(1))
    child.expect(r"\[(\d+) prompt \+ 8 tokens")
    answer = ANSI.sub("", child.before).split("…")[-1]
    prompt_tokens = int(child.match.group(1))
    child.expect(pexpect.EOF)

    assert spinner_tokens == prompt_tokens
    assert re.search(r"[A-Za-z]{3}", answer)  # the answer came after the spinner


def test_info_takes_the_model_as_argument_or_m(model_path):
    positional = invoke("info", str(model_path), "-c", "1024", "-s", "2")
    with_m = invoke("info", "-m", str(model_path), "--ctx-size", "1024", "-s", "2")
    assert positional.exit_code == 0 and positional.output == with_m.output
    assert "2 x 1024 tokens" in with_m.output
    both = invoke("info", "a-model", "-m", "another")
    assert both.exit_code == 1 and "two models given" in both.stderr


# a running server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    process = subprocess.Popen(
        [*CLI, "serve", "--model", str(model_path), *ENGINE, "--port", "0", "-c", "1024",
         "--alias", "gpt-4o-mini", "--alias", "local-model"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    match = re.search(r"serving (.+) at (http://\S+)/v1", line)
    assert match, line
    yield match.group(2), match.group(1).split(", ")
    process.terminate()
    process.wait(timeout=60)


def test_serve_answers_to_its_aliases_and_unknown_names_stay_404(server):
    url, names = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

    assert names[1:] == ["gpt-4o-mini", "local-model"]
    assert [m.id for m in client.models.list()] == names
    answer = client.chat.completions.create(model="gpt-4o-mini", max_tokens=4,
                                            messages=[{"role": "user", "content": "Hi!"}])
    assert answer.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as failure:
        client.chat.completions.create(model="gpt-5", max_tokens=4, messages=[{"role": "user", "content": "Hi!"}])
    assert failure.value.code == "model_not_found"


def test_ps_shows_what_the_server_holds(server):
    url, names = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    streaming = threading.Event()

    def long_answer() -> None:
        stream = client.completions.create(model="local-model", prompt="Once upon a time", max_tokens=300,
                                           stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            streaming.set()

    thread = threading.Thread(target=long_answer)
    thread.start()
    try:
        assert streaming.wait(TIMEOUT)
        state = json.loads(invoke("ps", "--url", url, "--json").stdout)
        text = invoke("ps", "--url", url).stdout
    finally:
        thread.join(TIMEOUT)

    assert state["models"] == names and state["max_model_len"] == 1024
    assert state["status"] == "ok" and state["running"] == 1
    assert state["kv"]["used"] + state["kv"]["shared"] > 0
    assert f"models  {', '.join(names)}" in text and "KV pool" in text and "1 running" in text
    nobody = invoke("ps", "--url", "http://127.0.0.1:9")
    assert nobody.exit_code == 1 and nobody.stderr.startswith("error: no server answers")


def test_bench_honours_the_workload_with_url(server, model_path):
    url, _ = server
    result = invoke("bench", "--model", str(model_path), "--url", url, "-w", "sweep", "--streams", "2", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["sweep"][0]["streams"] == 2 and figures["sweep"][0]["output_tokens_per_s"] > 0
    assert not {"single", "mixed", "prefix"} & figures.keys()


# local models ------------------------------------------------------------------------------


def test_models_lists_converted_folders_and_rm_deletes_them(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    out = tmp_path / "smol-8bit"
    converted = invoke("convert", str(model_path), "-o", str(out), "--bits", "8")
    assert converted.exit_code == 0, converted.output
    assert "layers are 4-bit; 8-bit holds the same values in more bytes" in converted.stderr

    local = json.loads(invoke("models", "--json").stdout)["local"]
    assert [(m["name"], m["kind"]) for m in local] == [(str(out), "converted")]
    assert "8-bit" in local[0]["detail"] and local[0]["size_bytes"] > 0
    assert str(out) in invoke("models").stdout

    kept = invoke("rm", str(out), input="n\n")
    assert out.is_dir() and "deleted" not in kept.stdout
    assert invoke("rm", "--yes", str(out)).exit_code == 0
    assert not out.exists()
    assert json.loads(invoke("models", "--json").stdout)["local"] == []
    unknown = invoke("rm", "--yes", "no-such-model")
    assert unknown.exit_code == 1 and "no local model 'no-such-model'" in unknown.stderr


def test_convert_report_says_up_front_what_it_runs(loaded_model):
    tokens = len(loaded_model.tokenizer.encode(SHIPPED_TEXT.read_text(encoding="utf-8")))
    notice = report_notice(loaded_model)
    assert f"{len(windows(tokens, REPORT_CTX, REPORT_CTX // 2))} windows of {REPORT_CTX} tokens" in notice
    assert "1/2 the source, then 2/2 the converted model" in notice
    assert re.search(r"roughly \d+ (s|min)", notice)


# bench on the engine -----------------------------------------------------------------------


def test_bench_shows_progress_within_a_request_and_tables_in_ms(model_path):
    result = invoke("bench", "--model", str(model_path), *ENGINE, "-w", "sweep", "--streams", "1")
    assert result.exit_code == 0, result.output
    done = [int(n) for n in re.findall(r"(\d+)/128 \[", result.stderr)]
    assert any(0 < n < 128 for n in done)  # the bar moved while the one request ran
    assert "1 stream:" in result.stderr
    assert "time per output token p50 (ms)" in result.stderr and "output tokens/s" in result.stderr


def test_bench_sweep_at_a_longer_context_reads_a_shared_prefix(model_path):
    """--context 600: each stream holds 600 tokens when it starts decoding, 472 of them a prefix computed once and
    then found in the prefix cache by both streams."""
    result = invoke("bench", "--model", str(model_path), *ENGINE, "-w", "sweep", "--streams", "2", "--context", "600",
                    "--kv-dtype", "int8", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["sweep"][0]
    assert row["streams"] == 2 and row["context"] == 600 and row["decode_tokens_per_s"] > 0
    assert "shared prefix" in result.stderr
    refused = invoke("bench", "--model", str(model_path), "--url", "http://127.0.0.1:9", "--context", "600")
    assert refused.exit_code != 0 and "--context" in refused.output


def test_eval_perplexity_scores_windows_as_long_as_its_context(model_path, tmp_path):
    """-c sets the window and the context alike: a window of exactly -c tokens is scored, not refused."""
    text = tmp_path / "text.txt"
    text.write_text(SHIPPED_TEXT.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    result = invoke("eval", "perplexity", "--model", str(model_path), *ENGINE, "-c", "64", "--text", str(text))
    assert result.exit_code == 0, result.output
    figures = re.search(r"perplexity ([\d.]+) over (\d+) tokens \((\d+) windows, ctx 64, stride 32\)", result.output)
    assert figures and 1 < float(figures[1]) < 200 and int(figures[3]) > 2
