"""Commands start at once: the `edgeserve` group and every command's --help import none of the heavy
modules (the server, the TUI, the engine's array libraries), which load only in the commands that use them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import click
import pytest

from edgeserve.cli.main import COMMANDS, cli

# FastAPI and uvicorn (serve), Textual (tui), numba (the kernels' fallback), MLX and NumPy (the engine),
# and what only a model's load needs: transformers (some tokenizers), llguidance (grammars), jinja2 (chat templates)
HEAVY = ("fastapi", "uvicorn", "textual", "numba", "mlx", "numpy", "transformers", "llguidance", "jinja2")

# Runs the group as the `edgeserve` script does, then prints the heavy modules it imported as JSON on stderr.
PROBE = """
import json, sys
from edgeserve.cli.main import cli
try:
    cli(sys.argv[1:], prog_name="edgeserve")
finally:
    print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)), file=sys.stderr)
"""


def _run(*args: str, heavy: tuple[str, ...] = HEAVY) -> tuple[str, list[str]]:
    """stdout of `edgeserve ARGS` in a fresh interpreter, and the heavy modules it imported."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=heavy), *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


def test_importing_the_command_loads_no_heavy_module():
    code = f"import sys, edgeserve.cli.main; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_help_lists_every_command_and_imports_nothing_heavy():
    out, heavy = _run("--help")
    assert heavy == []
    listed = re.findall(r"^  (\S+)\s", out.split("Commands:\n", 1)[1], flags=re.MULTILINE)
    assert listed == sorted(COMMANDS)


# Every command's --help in turn in one interpreter: a command that imported a heavy module would leave it
# in sys.modules, seen right after that command.
EACH_HELP = """
import contextlib, io, json, sys
from edgeserve.cli.main import cli
seen = {{}}
for command in {commands!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli([*command, "--help"], prog_name="edgeserve")
        except SystemExit:
            pass
    seen[" ".join(command)] = [out.getvalue(), sorted(m for m in {heavy!r} if m in sys.modules)]
print(json.dumps(seen))
"""


def test_each_commands_help_imports_nothing_heavy():
    commands = [[name] for name in COMMANDS] + [["eval", "perplexity"]]
    done = subprocess.run([sys.executable, "-c", EACH_HELP.format(commands=commands, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert list(seen) == [" ".join(c) for c in commands]
    for command, (out, heavy) in seen.items():
        assert out.startswith(f"Usage: edgeserve {command} "), command
        assert heavy == [], command


def test_the_listing_summaries_are_the_commands_own():
    """The group lists each command from its table: it must say what the command's own help says."""
    ctx = click.Context(cli)
    for name, entry in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command.name == name
        assert entry.summary == command.get_short_help_str(limit=10**6), name


def test_an_answer_without_a_grammar_loads_no_grammar_engine(model_path, tmp_path):
    # llguidance (~15 ms) loads when a grammar is compiled; numpy.ma (~10 ms) came with np.unique's first call,
    # which the chat's default repeat penalty made
    out, loaded = _run("run", "-m", str(model_path), "-n", "3", "Hi", heavy=("llguidance", "numpy.ma", "numpy"))
    assert out.strip() and loaded == ["numpy"]
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    out, loaded = _run("run", "-m", str(model_path), "-n", "3", "--json-schema", str(schema), "Hi",
                       heavy=("llguidance",))
    assert out.strip().startswith("{") and loaded == ["llguidance"]


def test_the_numpy_backend_imports_numba_only_for_the_fallback():
    code = ("import sys; from edgeserve.backends import get_backend, qmatmul; get_backend('numpy'); "
            "print(qmatmul.compiled(), 'numba' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    compiled, numba_loaded = done.stdout.split()
    if compiled != "True":
        pytest.skip("the C extension is not built: the numba kernels are the ones in use")
    assert numba_loaded == "False"
