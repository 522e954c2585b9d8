"""The wheel a user builds holds every part of edgeserve, and works installed non-editable.

How, and why this way:

- The source tree is copied (without build outputs, virtual environments or compiled extensions)
  and the wheel is built from the copy with `pip wheel --no-deps`, as a user would build it.
  setuptools keeps a `build/` folder in the tree it builds and never empties it, so a wheel built
  in the checkout could carry modules that no longer exist; building the copy also leaves the
  checkout alone while others build or test in it.
- The wheel goes into a fresh venv (no pip of its own; the running pip installs into it through
  `--python`) with `--no-deps`. The dependencies come from the environment running this test:
  a `.pth` file in the new venv names its site-packages. A directory named in a `.pth` file is
  only added to `sys.path`, after the venv's own site-packages, and the `.pth` files inside it are
  not run, so the editable install's import hook never loads. The test still proves where the code
  comes from: every edgeserve package must import from the new venv's site-packages.
- `edgeserve info` and `edgeserve run` then run from the venv's console script, in a folder
  outside the source tree, against the catalog's default model in the cache the other tests use.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from site import getsitepackages as site_packages

from edgeserve.models.catalog import home

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# each top-level source folder, by where its files go in the wheel
PARTS = {"edgeserve": "edgeserve", "models": "edgeserve/models", "quant": "edgeserve/quant",
         "metal": "edgeserve/metal", "cli": "edgeserve/cli"}
SUBPACKAGES = ["edgeserve/backends", "edgeserve/engine", "edgeserve/server", "edgeserve/server/openai", "edgeserve/text",
               "edgeserve/bench", "edgeserve/models", "edgeserve/quant", "edgeserve/metal", "edgeserve/cli"]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".hypothesis", "*.so", "*.pyd", "tests")
TIMEOUT = 300  # seconds for one step on a slow, shared CPU


def sources(*patterns: str) -> set[str]:
    """The source files matching patterns, each by the path it takes in the wheel."""
    return {f"{prefix}/{path.relative_to(ROOT / folder).as_posix()}"
            for folder, prefix in PARTS.items() for pattern in patterns
            for path in (ROOT / folder).rglob(pattern) if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_SOURCE)
    # compiled without debug information (setuptools appends CFLAGS to Python's own "-g ... -O3"): it
    # is a third of the C kernels' compile time, and nothing here reads it
    env = {**os.environ, "CFLAGS": f"{os.environ.get('CFLAGS', '')} -g0".strip()}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(tmp / "src"), "-w", str(tmp / "dist")],
                   check=True, timeout=TIMEOUT, env=env)
    (built,) = (tmp / "dist").glob("edgeserve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel, non-editable; the dependencies are the running environment's."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=TIMEOUT)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # every site-packages of the running environment: a venv made with --system-site-packages holds
    # its dependencies in the base interpreter's
    ours = dict.fromkeys([*site_packages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "test-environment.pth").write_text("".join(f"{path}\n" for path in ours))
    return venv


def run_in(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Run a program of the venv, as a user of that venv would: no PYTHONPATH, outside the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(EDGESERVE_HOME=str(home()), PYTHONNOUSERSITE="1")
    result = subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    return result


def test_the_wheel_holds_every_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())

    for package in SUBPACKAGES:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    missing = sources("*.py", "*.metal", "*.cu") - names
    assert not missing, f"source files missing from the wheel: {sorted(missing)}"
    data = sources("data/*.txt", "data/*.md", "web/*.html", "web/*.css", "web/*.js", "web/*.svg")
    assert any(name.startswith("edgeserve/evaluation/data/") for name in data)
    assert "edgeserve/server/web/index.html" in data and "edgeserve/server/web/app.js" in data
    missing = data - names
    assert not missing, f"data files missing from the wheel: {sorted(missing)}"


def test_the_installed_wheel_imports_from_its_venv(venv, tmp_path):
    site = (venv / "lib").resolve()
    packages = ["edgeserve", *(p.replace("/", ".") for p in SUBPACKAGES)]
    script = f"import importlib; print('\\n'.join(importlib.import_module(p).__file__ for p in {packages!r}))"

    files = run_in(venv, tmp_path, "python", "-c", script).stdout.split()

    assert len(files) == len(packages)
    for package, file in zip(packages, files):
        assert Path(file).resolve().is_relative_to(site), f"{package} came from {file}, not from the new venv"


def test_info_and_run_work_from_the_installed_console_script(venv, model_path, tmp_path):
    info = run_in(venv, tmp_path, "edgeserve", "info").stdout

    assert "SmolLM2-135M-Instruct.Q4_1.gguf (gguf)" in info
    assert "llama: 30 layers, hidden 576" in info
    assert "23040 bytes (float16)" in info

    run = run_in(venv, tmp_path, "edgeserve", "run", "--backend", "numpy", "--kv-memory", "64MiB",
                 "--max-tokens", "8", "--temperature", "0", "--json", "What is the capital of France?")
    answer = json.loads(run.stdout)

    assert answer["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and answer["backend"] == "numpy"
    assert 0 < answer["completion_tokens"] <= 8
    assert "Paris" in answer["text"]
