"""Run llama.cpp's own tools and edgeserve on one GGUF in one sitting and print edgeserve / llama.cpp ratios.

Absolute speeds differ between machines, so only ratios measured side by side mean anything:

- single: one stream, `edgeserve bench -w single` vs `llama-bench` tg128 (decode from an empty context
  and after 512 tokens, `-d 512`) and pp512 (prefill);
- batched: aggregate decode of N streams of 128 prompt + 128 generated tokens,
  `edgeserve bench -w sweep` vs `llama-batched-bench -npp 128 -ntg 128 -npl N`;
- http: `edgeserve serve` vs `llama-server -np CLIENTS`, the same seeded load of streaming clients
  from `edgeserve bench --url` against each: aggregate output tokens/s and TTFT p50;
- bandwidth: a sequential-read probe of this machine's memory (its best in the sitting: probed again
  after each engine's single-stream run), and each engine's decode step as (GGUF bytes read per
  token) x (single-stream tg128 tokens/s), as a share of it;
- startup: launch to first token and exit, `edgeserve run -n 1` vs `llama-simple -n 1` (one
  generated token from the same raw prompt), with each process's peak resident memory; edgeserve's
  first start (which writes its panel cache, in a temporary EDGESERVE_HOME) and later ones apart.

The model is a GGUF file or a catalog name (-m gemma3-270m); the report names its shape. Files of
the sizes people run, with random weights, come from bench/make_gguf.py.

edgeserve is driven only through its CLI and HTTP API. llama.cpp's binaries come from --llama-cpp
DIR, $EDGESERVE_LLAMA_CPP, the cache ($EDGESERVE_HOME/llama.cpp, default ~/.cache/edgeserve/llama.cpp)
or PATH; failing those, they are built into the cache from the llama-cpp-python sdist (needs cmake
and a C++ compiler; 10-25 minutes on 2 cores).

    python bench/compare_llamacpp.py
    python bench/compare_llamacpp.py --only single,bandwidth --json
    python bench/compare_llamacpp.py --streams 16,64 --http-requests 32 --llama-cpp ~/src/llama.cpp/build/bin
    python bench/compare_llamacpp.py -m llama-3b-q4_0.gguf --only single,bandwidth,startup
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from edgeserve.backends import ACTIVATION_MODES, DEFAULT_ACTIVATIONS, KV_DTYPES
from edgeserve.models.catalog import CATALOG, DEFAULT_MODEL, home, pull
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.system import usable_cores

# llama-cpp-python's sdist vendors a llama.cpp that builds on Linux and macOS with plain cmake.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")
SINGLE_ROUNDS = 2  # rounds of the single-stream figures, the engines taking turns
# edgeserve's single-stream figures taken as the best of the rounds (the rest of its report is the last round's)
SINGLE_FIGURES = ("decode_empty_context_tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s")
STARTUP_TOOL = "llama-simple"  # loads (maps) the model, evaluates the prompt, prints tokens, exits
ENV_VAR = "EDGESERVE_LLAMA_CPP"
PARTS = ("single", "batched", "http", "bandwidth", "startup")
STARTUP_PROMPT = "hi"
# edgeserve's sweep and llama-batched-bench both run streams of this many prompt and generated tokens.
SWEEP_PROMPT, SWEEP_OUTPUT = 128, 128
EDGESERVE = [sys.executable, "-m", "edgeserve.cli"]  # the CLI of the interpreter running this script

console = Console(stderr=True)


class ToolError(RuntimeError):
    """A benchmark tool or server failed; the message carries the tail of its output."""


# ---- finding or building llama.cpp ----------------------------------------------------------------

def cache_dir() -> Path:
    return home() / "llama.cpp"


def tool_dir(candidate: Path) -> Path | None:
    """The folder holding all three tools: the candidate itself, its bin/ or its build/bin/."""
    for d in (candidate, candidate / "bin", candidate / "build" / "bin"):
        if all(os.access(d / t, os.X_OK) for t in TOOLS):
            return d
    return None


def cached_source() -> Path:
    """Where the sdist's llama.cpp is unpacked in the cache."""
    return cache_dir() / SDIST_DIR / "vendor" / "llama.cpp"


def find_llama_cpp(explicit: Path | None) -> Path | None:
    """--llama-cpp, then $EDGESERVE_LLAMA_CPP (both must hold the tools), then the cache, then PATH."""
    for given, origin in ((explicit, "--llama-cpp"), (os.environ.get(ENV_VAR), f"${ENV_VAR}")):
        if given:
            found = tool_dir(Path(given).expanduser())
            if found is None:
                raise click.UsageError(f"{origin} {given}: no {', '.join(TOOLS)} there (nor in bin/, build/bin/)")
            return found
    on_path = shutil.which(TOOLS[0])
    for candidate in (cached_source() / "build" / "bin", Path(on_path).parent if on_path else None):
        if candidate and (found := tool_dir(candidate)):
            return found
    return None


def build_llama_cpp(progress: Progress) -> Path:
    """Download the llama-cpp-python sdist into the cache, unpack it, and build the three tools with cmake."""
    if shutil.which("cmake") is None:
        raise ToolError("building llama.cpp needs cmake (`pip install cmake` works) and a C++ compiler")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    source = cached_source()
    task = progress.add_task("llama.cpp: download sdist", total=100, detail="")
    if not source.is_dir():
        # Only this package from source: its build requirements (cmake among them) may come as wheels.
        run_tool([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                  f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)], progress, task)
        progress.update(task, description="llama.cpp: unpack")
        # Unpacked aside and moved in whole, so an interrupted unpack never looks like a source tree.
        with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(root / f"{SDIST_DIR}.tar.gz") as tar:
            tar.extractall(tmp, filter="data")
            (Path(tmp) / SDIST_DIR).rename(root / SDIST_DIR)
    progress.update(task, description="llama.cpp: cmake configure")
    run_tool(["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"], progress, task)
    progress.update(task, description="llama.cpp: build")
    run_tool(["cmake", "--build", str(source / "build"), "-j", str(usable_cores()), "--target", *TOOLS, STARTUP_TOOL],
             progress, task, percent=re.compile(r"^\[\s*(\d+)%\]"))
    progress.update(task, completed=100)
    found = tool_dir(source / "build")
    if found is None:
        raise ToolError(f"the build finished but {', '.join(TOOLS)} are not in {source / 'build' / 'bin'}")
    return found


# ---- running tools with visible progress ----------------------------------------------------------

def run_tool(cmd: list[str], progress: Progress, task: TaskID, percent: re.Pattern | None = None) -> str:
    """Run a command to the end, showing its latest stderr line live; return its stdout.

    With `percent`, stdout joins the live lines (cmake's build reports its progress there) and lines
    matching it set the task's completion; nothing is returned then.
    """
    tail: deque[str] = deque(maxlen=30)
    with tempfile.TemporaryFile() as out:
        if percent:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE)
        live = proc.stdout if percent else proc.stderr
        pending = b""
        # tqdm redraws with \r, so split on both line ends to follow the bars of edgeserve's own commands.
        for chunk in iter(lambda: live.read1(8192), b""):
            *lines, pending = re.split(rb"[\r\n]", pending + chunk)
            for line in filter(None, (raw.decode(errors="replace").strip() for raw in lines)):
                tail.append(line)
                progress.update(task, detail=escape(line[:max(10, progress.console.width - 62)]))
                if percent and (m := percent.match(line)):
                    progress.update(task, completed=int(m.group(1)))
        if proc.wait():
            hint = illegal_instruction(proc.returncode)
            raise ToolError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}{hint}:\n" + "\n".join(tail))
        out.seek(0)
        return out.read().decode(errors="replace")


def illegal_instruction(returncode: int) -> str:
    """A hint for a peer killed by SIGILL, else nothing."""
    if returncode != -signal.SIGILL:
        return ""
    # GGML_NATIVE compiles in every instruction the CPU names, AMX included, which some virtual machines
    # name but refuse (prompts crash, decode runs)
    return (" (an illegal instruction: a -DGGML_NATIVE=ON build can use AMX, which this machine refuses; rebuild "
            "with -DGGML_NATIVE=OFF and the CPU's other GGML_AVX* options on, GGML_AMX_* off)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A child's peak RSS as the kernel reports it is at least its parent's peak when it was forked (Linux carries a
# process's high-water mark across fork and exec): the bandwidth probe's 1 GiB array made every later start of a
# full run read 0.5x the model larger. So each timed command is started by a small Python process of its own,
# which times it and reports the peak of its one child.
_LAUNCHER = """import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(code, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def timed_process(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run a command to its exit: (wall seconds from launch, its peak resident bytes)."""
    with tempfile.TemporaryFile() as err:
        done = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], stdout=subprocess.PIPE, stderr=err, env=env,
                              text=True)
        report = done.stdout.split()
        # the command's exit code, or the launcher's where it could not start the command
        code, wall, maxrss = (int(report[0]), float(report[1]), int(report[2])) if len(report) == 3 else (
            done.returncode or 1, 0.0, 0)
        if code:
            err.seek(0)
            hint = illegal_instruction(code)
            raise ToolError(f"{' '.join(cmd[:4])} ... exited with {code}{hint}:\n"
                            + err.read().decode(errors="replace")[-3000:])
    # ru_maxrss is KiB on Linux, bytes on macOS
    return wall, maxrss * (1 if sys.platform == "darwin" else 1024)


@contextmanager
def server(cmd: list[str], url: str, progress: Progress, task: TaskID, timeout: float = 600.0) -> Iterator[str]:
    """Start a server, wait until /health answers 200, yield the model id it serves, and stop it."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise ToolError(f"{Path(cmd[0]).name} exited with {proc.returncode} before it was ready:\n"
                                    + log.read().decode(errors="replace")[-3000:])
                if time.monotonic() > deadline:
                    raise ToolError(f"{url}/health did not answer 200 within {timeout:.0f}s")
                try:
                    # llama-server answers 503 while it loads the model; edgeserve does not listen until loaded.
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            progress.update(task, detail="ready")
            yield httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- the measurements ------------------------------------------------------------------------------

class Bench:
    """One sitting: the GGUF, the tools, the settings, and the figures gathered so far."""

    def __init__(self, gguf: Path, bin_dir: Path, threads: int, weights: str, activations: str | None,
                 kv_memory: str, kv_dtype: str, progress: Progress, probe_size: int | None = None) -> None:
        self.gguf, self.bin, self.threads = gguf, bin_dir, threads
        self.weights, self.activations, self.progress = weights, activations, progress
        self.kv_memory, self.kv_dtype = kv_memory, kv_dtype
        self.probe_size = probe_size  # None: no bandwidth figures asked for
        self.probes: dict[int, float] = {}  # threads -> the best read so far, GB/s
        self.results: dict[str, Any] = {}

    def edgeserve_args(self) -> list[str]:
        """Model options shared by `edgeserve bench` and `edgeserve serve`: the CPU backend on the same file, decoding
        as llama.cpp's tools do here, without speculative decoding (on by default on the CPU: a random model's
        repetitive text would be guessed)."""
        args = ["-m", str(self.gguf), "--backend", "numpy", "--weights", self.weights, "--kv-memory", self.kv_memory,
                "--kv-dtype", self.kv_dtype, "--threads", str(self.threads), "--speculative", "off"]
        return [*args, "--activations", self.activations] if self.activations else args

    def edgeserve_serve(self, port: int) -> list[str]:
        """`edgeserve serve` cold, as llama-server starts: no disk tier of the prefix cache, which serve keeps on by
        default and which would load the K/V a former sitting's identical prompts left (a 16-client run of the 1B
        Q4_K_M file gave 40 output tok/s, then 132 with the first run's prompts on disk)."""
        return [*EDGESERVE, "serve", *self.edgeserve_args(), "--prefix-cache-disk", "0", "--port", str(port)]

    def llama_args(self) -> list[str]:
        # -ngl 0 keeps llama.cpp on the CPU where it was built with Metal or CUDA, like NumPy's backend.
        return ["-m", str(self.gguf), "-t", str(self.threads), "-ngl", "0"]

    def edgeserve_bench(self, task: TaskID, *args: str) -> dict:
        return json.loads(run_tool([*EDGESERVE, "bench", *self.edgeserve_args(), "--json", *args], self.progress, task))

    def single(self, repetitions: int) -> None:
        """One stream: decode (tg128, from an empty context and after 512 tokens) and 512-token prefill (pp512), in
        SINGLE_ROUNDS rounds with the engines taking turns, each figure the best of its rounds: a machine whose
        speed drifts over the minutes a round takes favours neither (one round read a 1B decode at 0.96x llama.cpp
        in one sitting and 1.01x in the next)."""
        # edgeserve's single stream decodes 128 tokens from a one-token prompt (tg128's work) and after its
        # 512-token prompt (tg128 at depth 512: more KV reads per token).
        task = self.progress.add_task("single: llama-bench pp512 + tg128", total=None, detail="")
        bench = [str(self.bin / "llama-bench"), *self.llama_args(), "-r", str(repetitions), "-o", "json"]
        theirs: dict[str, dict] = {}
        ours: dict[str, Any] = {}
        for round_ in range(1, SINGLE_ROUNDS + 1):
            self.progress.update(task, description=f"single, round {round_}: llama-bench pp512 + tg128")
            runs = json.loads(run_tool([*bench, "-p", "512", "-n", "128"], self.progress, task))
            deep = json.loads(run_tool([*bench, "-p", "0", "-n", "128", "-d", "512"], self.progress, task))[0]
            found = {"pp512": next(r for r in runs if r["n_prompt"] == 512 and r["n_gen"] == 0),
                     "tg128": next(r for r in runs if r["n_prompt"] == 0 and r["n_gen"] == 128), "tg128_at_512": deep}
            for name, run in found.items():
                if name not in theirs or run["avg_ts"] > theirs[name]["avg_ts"]:
                    theirs[name] = run
            self.read_probe()
            self.progress.update(task, description=f"single, round {round_}: edgeserve bench -w single")
            mine = self.edgeserve_bench(task, "-w", "single")["single"]
            for key in SINGLE_FIGURES:
                if key in ours:
                    mine[key] = max(mine[key], ours[key])
            ours = mine
            self.read_probe()
        tg = theirs["tg128"]
        self.results["llama_cpp_build"] = {"commit": tg.get("build_commit"), "number": tg.get("build_number"),
                                           "cpu": tg.get("cpu_info"), "bin": str(self.bin)}
        self.results["single"] = {
            "edgeserve": ours,
            "llama_cpp": {f"{name}{suffix}": round(run[field], 2) for name, run in theirs.items()
                          for suffix, field in (("_tokens_per_s", "avg_ts"), ("_stddev", "stddev_ts"))},
        }
        self.progress.update(task, total=1, completed=1, detail="")

    def batched(self, streams: list[int]) -> None:
        """Aggregate decode of N streams of 128 + 128 tokens; end-to-end output tokens/s beside it."""
        label = f"batched: llama-batched-bench -npl {','.join(map(str, streams))}"
        task = self.progress.add_task(label, total=None, detail="")
        # batched-bench silently skips a batch whose streams do not all fit in -c.
        ctx = max(streams) * (SWEEP_PROMPT + SWEEP_OUTPUT)
        out = run_tool([str(self.bin / "llama-batched-bench"), *self.llama_args(), "-tb", str(self.threads),
                        "-c", str(ctx), "-npp", str(SWEEP_PROMPT), "-ntg", str(SWEEP_OUTPUT),
                        "-npl", ",".join(map(str, streams)), "--output-format", "jsonl"], self.progress, task)
        theirs = {r["pl"]: r for r in map(json.loads, re.findall(r'^\{"n_kv_max".*\}$', out, re.M))}
        self.progress.update(task, description="batched: edgeserve bench -w sweep")
        sweep = self.edgeserve_bench(task, "-w", "sweep", "--streams", ",".join(map(str, streams)))["sweep"]
        ours = {r["streams"]: r for r in sweep}
        rows = []
        for n in streams:
            ll, es = theirs.get(n), ours.get(n)
            rows.append({
                "streams": n,
                "edgeserve_decode_tokens_per_s": es and es["decode_tokens_per_s"],
                "llama_cpp_decode_tokens_per_s": ll and round(ll["speed_tg"], 2),
                "edgeserve_output_tokens_per_s": es and es["output_tokens_per_s"],
                # batched-bench's own S counts prompt tokens too; this counts generated ones, as ours does.
                "llama_cpp_output_tokens_per_s": ll and round(n * SWEEP_OUTPUT / ll["t"], 2),
            })
        self.results["batched"] = rows
        self.progress.update(task, total=1, completed=1, detail="")

    def http(self, clients: int, requests: int) -> None:
        """The same load of streaming clients against llama-server and edgeserve serve, one after the other."""
        task = self.progress.add_task("http", total=None, detail="")
        # llama-server refuses connections beyond its HTTP threads: one per client, plus room for /health.
        # Each of its slots gets -c / -np tokens; the load's prompts (<= 256) and outputs (<= 128) fit 1024.
        servers = {
            "llama_cpp": lambda port: [str(self.bin / "llama-server"), *self.llama_args(), "-tb", str(self.threads),
                                       "-np", str(clients), "-c", str(clients * 1024),
                                       "--threads-http", str(clients + 4), "--host", "127.0.0.1", "--port", str(port)],
            "edgeserve": self.edgeserve_serve,
        }
        self.results["http"] = {}
        for name, command in servers.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            label = "llama-server" if name == "llama_cpp" else "edgeserve serve"
            self.progress.update(task, description=f"http: {label} + {clients} clients", detail="starting")
            with server(command(port), url, self.progress, task) as model_id:
                figures = self.edgeserve_bench(task, "--url", url, "-w", "mixed", "--served-model", model_id,
                                               "--concurrency", str(clients), "--requests", str(requests))["mixed"]
            if figures["output_tokens"] < figures["requested_output_tokens"]:
                self.progress.console.print(f"[yellow]{name} generated {figures['output_tokens']} of "
                                            f"{figures['requested_output_tokens']} requested tokens (stopped early)")
            self.results["http"][name] = figures
        self.progress.update(task, total=1, completed=1, detail="")

    def startup(self, repetitions: int) -> None:
        """Launch to first token: `edgeserve run -n 1` (first start, then with its panel cache) vs `llama-simple`."""
        simple = self.bin / STARTUP_TOOL
        if not os.access(simple, os.X_OK):
            raise ToolError(f"no {simple}: build it with `cmake --build {self.bin.parent} --target {STARTUP_TOOL}`")
        task = self.progress.add_task("startup: edgeserve run -n 1, first start", total=None, detail="")
        ours = [*EDGESERVE, "run", *self.edgeserve_args(), "-n", "1", "--raw", STARTUP_PROMPT]
        # A fresh cache folder makes the first start build the panels, as a user's first run does.
        with tempfile.TemporaryDirectory() as cache_home:
            env = {**os.environ, "EDGESERVE_HOME": cache_home}
            env.pop("EDGESERVE_PANEL_CACHE", None)
            # Python's compiled bytecode is written by the first start and read by the others, as an installed
            # package's is (pip compiles it): without it every start compiles edgeserve's sources again
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            first = timed_process(ours, env)
            self.progress.update(task, description="startup: edgeserve run -n 1, cached")
            later = [timed_process(ours, env) for _ in range(repetitions)]
        self.progress.update(task, description=f"startup: {STARTUP_TOOL} -n 1")
        theirs = [timed_process([str(simple), "-m", str(self.gguf), "-n", "1", STARTUP_PROMPT])
                  for _ in range(repetitions)]
        best = lambda runs: min(runs)  # noqa: E731 - the fastest run: the least disturbed by other work
        self.results["startup"] = {
            "model_bytes": self.gguf.stat().st_size,
            "edgeserve_first_s": round(first[0], 2), "edgeserve_first_peak_rss_bytes": first[1],
            "edgeserve_s": round(best(later)[0], 2), "edgeserve_peak_rss_bytes": max(r[1] for r in later),
            "llama_cpp_s": round(best(theirs)[0], 2), "llama_cpp_peak_rss_bytes": max(r[1] for r in theirs),
        }
        self.progress.update(task, total=1, completed=1, detail="")

    def read_probe(self, repeats: int = 5) -> None:
        """Best sequential read of an in-memory array, on one thread and on all, into self.probes (kept where an
        earlier probe of the sitting read faster). single probes after each engine's run: this machine's bus changes
        speed between minutes (a one-thread read 24-32 GB/s in one hour), and a probe taken once, in a slow minute,
        put a decode measured in a fast one at 1.2x the read."""
        if self.probe_size is None:
            return
        data = np.ones(self.probe_size // 8)  # written once, so every page is resident before timing
        for threads in sorted({1, self.threads}):
            best = float("inf")
            # NumPy's reductions release the GIL, so threads read their chunks in parallel. A float64 sum
            # is slower than memory on some CPUs (8-10 GB/s a core where a byte max reads 15), so the
            # probe is the faster of the two reads.
            with ThreadPoolExecutor(threads) as pool:
                for reduce, view in ((np.sum, data), (np.max, data.view(np.uint8))):
                    chunks = np.array_split(view, threads)
                    for _ in range(repeats):
                        start = time.perf_counter()
                        list(pool.map(reduce, chunks))
                        best = min(best, time.perf_counter() - start)
            self.probes[threads] = max(self.probes.get(threads, 0.0), round(data.nbytes / best / 1e9, 2))

    def bandwidth(self) -> None:
        """The best read probe of the sitting (single's and one more now); decode's share of it."""
        task = self.progress.add_task(f"bandwidth: read a {self.probe_size / 2**30:g} GiB array", total=None,
                                      detail="")
        self.read_probe()
        probes = {f"read_GBps_{threads}_threads": speed for threads, speed in sorted(self.probes.items())}
        probe = max(probes.values())
        entry: dict[str, Any] = {**probes, "read_GBps": probe, "probe_bytes": self.probe_size,
                                 "weight_bytes_per_token": self.gguf.stat().st_size}
        if single := self.results.get("single"):
            per_token = self.gguf.stat().st_size / 1e9
            ours = per_token * single["edgeserve"]["decode_empty_context_tokens_per_s"]
            theirs = per_token * single["llama_cpp"]["tg128_tokens_per_s"]
            entry |= {"edgeserve_decode_GBps": round(ours, 2), "llama_cpp_decode_GBps": round(theirs, 2),
                      "edgeserve_share": round(ours / probe, 3), "llama_cpp_share": round(theirs / probe, 3)}
        self.results["bandwidth"] = entry
        self.progress.update(task, total=1, completed=1, detail="")


# ---- the report ------------------------------------------------------------------------------------

def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if ours and theirs else None


def table_rows(results: dict) -> list[dict]:
    """One row per figure: edgeserve, llama.cpp, edgeserve / llama.cpp, and issue 12's goal for it."""
    rows = []

    def add(figure: str, ours: float | None, theirs: float | None, goal: str = "") -> None:
        rows.append({"figure": figure, "edgeserve": ours, "llama_cpp": theirs, "ratio": ratio(ours, theirs),
                     "goal": goal})

    if single := results.get("single"):
        es, ll = single["edgeserve"], single["llama_cpp"]
        add("decode tok/s, 1 stream (tg128)", es["decode_empty_context_tokens_per_s"], ll["tg128_tokens_per_s"],
            ">= 1.0")
        add("decode tok/s, after 512 (-d 512)", es["decode_tokens_per_s"], ll["tg128_at_512_tokens_per_s"], ">= 1.0")
        add("prefill tok/s, 512", es["prefill_tokens_per_s"], ll["pp512_tokens_per_s"], ">= 1.0")
    for r in results.get("batched", []):
        goal = {16: ">= 1.5", 64: ">= 2.0"}.get(r["streams"], "")
        add(f"decode tok/s, {r['streams']} stream" + "s" * (r["streams"] > 1), r["edgeserve_decode_tokens_per_s"],
            r["llama_cpp_decode_tokens_per_s"], goal)
    for r in results.get("batched", []):
        add(f"whole out tok/s, {r['streams']} str.", r["edgeserve_output_tokens_per_s"],
            r["llama_cpp_output_tokens_per_s"])
    if (http := results.get("http")) and len(http) == 2:
        es, ll = http["edgeserve"], http["llama_cpp"]
        add(f"HTTP out tok/s, {es['concurrency']} cl.", es["output_tokens_per_s"], ll["output_tokens_per_s"],
            ">= 1.5")
        add("HTTP TTFT p50 s", es["ttft_p50_s"], ll["ttft_p50_s"], "<= 1.0")
        add("HTTP TPOT p50 s", es["tpot_p50_s"], ll["tpot_p50_s"])
    if st := results.get("startup"):
        size = st["model_bytes"]
        add("start to 1st token s", st["edgeserve_s"], st["llama_cpp_s"], "<= 1.0")
        add("first start s (panel cache)", st["edgeserve_first_s"], st["llama_cpp_s"])
        add("peak RSS / file size", round(st["edgeserve_peak_rss_bytes"] / size, 2),
            round(st["llama_cpp_peak_rss_bytes"] / size, 2), "es <= 1.1")
        add("peak RSS / file, first start", round(st["edgeserve_first_peak_rss_bytes"] / size, 2),
            round(st["llama_cpp_peak_rss_bytes"] / size, 2))
    if (bw := results.get("bandwidth")) and "edgeserve_share" in bw:
        add("decode GB/s", bw["edgeserve_decode_GBps"], bw["llama_cpp_decode_GBps"])
        # This goal is edgeserve's own share of the probe, not a ratio.
        add("decode / read probe", bw["edgeserve_share"], bw["llama_cpp_share"], "es >= 0.7")
    return rows


def print_table(results: dict) -> None:
    table = Table(title=f"{Path(results['model']).name} ({results['model_shape']}), {results['threads']} threads, "
                        f"edgeserve {results['activations']} activations",
                  box=box.SIMPLE_HEAD,
                  caption="ratio = edgeserve / llama.cpp. llama.cpp: llama-bench tg128 and pp512, "
                          "llama-batched-bench 128+128 per stream, llama-server. 'whole': output tokens over "
                          "prefill and decode time. startup: launch to exit of `edgeserve run -n 1` and "
                          f"`{STARTUP_TOOL} -n 1` (best run; first start: edgeserve builds its panel cache).")
    table.add_column("figure", no_wrap=True)
    for column in ("edgeserve", "llama.cpp", "ratio"):
        table.add_column(column, justify="right")
    table.add_column("goal")
    for r in results["rows"]:
        shown = ["—" if r[k] is None else str(r[k]) for k in ("edgeserve", "llama_cpp", "ratio")]
        table.add_row(r["figure"], *shown, r["goal"])
    console.print(table)
    if bw := results.get("bandwidth"):
        threads = "1 thread" if results["threads"] == 1 else f"1 and {results['threads']} threads"
        console.print(f"read probe: {bw['read_GBps']} GB/s, the sitting's best read of {bw['probe_bytes'] / 2**30:g} "
                      f"GiB on {threads} (float64 sum or byte max), probed around each single-stream run; decode "
                      f"GB/s = GGUF size ({bw['weight_bytes_per_token'] / 1e6:.1f} MB) x single-stream decode tok/s "
                      "(tg128)")
    if build := results.get("llama_cpp_build"):
        console.print(f"llama.cpp build {build['number']} ({build['commit']}) on {build['cpu']}: {build['bin']}")


def model_shape(path: Path) -> str:
    """The GGUF's architecture and sizes, and its tensor types by share of bytes: what the figures are of."""
    g = read_gguf(path)
    md, arch = g.metadata, g.architecture

    def get(key: str) -> Any:
        return md.get(f"{arch}.{key}", "?")

    by_type: dict[str, int] = {}
    for t in g.tensors.values():
        by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.data.nbytes
    total = sum(by_type.values())
    mix = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in sorted(by_type.items(), key=lambda kv: -kv[1])
                    if n / total >= 0.005)
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    return (f"{arch}: {get('block_count')} layers, hidden {get('embedding_length')}, "
            f"heads {get('attention.head_count')}/{get('attention.head_count_kv')}, MLP {get('feed_forward_length')}, "
            f"vocab {vocab}; {mix}; {path.stat().st_size / 1e9:.2f} GB")


def resolve_model(name: str | None) -> Path:
    """A GGUF path, or a catalog name (pulled if missing); the default model without either."""
    if name is None:
        return pull(DEFAULT_MODEL).resolve()
    if Path(name).expanduser().is_file():
        return Path(name).expanduser().resolve()
    if name in CATALOG:
        return pull(name).resolve()
    raise click.UsageError(f"-m {name}: no such file, and not a catalog name ({', '.join(CATALOG)})")


def parse_list(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


@click.command()
@click.option("--model", "-m", "model_name", default=None,
              help=f"GGUF file or catalog name (pulled if missing) [default: {DEFAULT_MODEL}]")
@click.option("--llama-cpp", "llama_cpp", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help=f"Folder with {', '.join(TOOLS)} (or its bin/, build/bin/) [default: "
                                 f"${ENV_VAR}, the cache, PATH, else build into the cache]")
@click.option("--only", default=",".join(PARTS), show_default=True,
              help="Parts to run, comma-separated; bandwidth needs single's decode figures, so it runs single too.")
@click.option("--streams", default="1,4,8,16,32,64", show_default=True, help="Stream counts for batched.")
@click.option("--http-clients", default=16, show_default=True, help="Concurrent streaming clients for http.")
@click.option("--http-requests", default=64, show_default=True, help="Requests in the http load.")
@click.option("--threads", "-t", default=usable_cores(), show_default=True,
              help="Threads for llama.cpp, edgeserve and the read probe.")
@click.option("--repetitions", "-r", default=5, show_default=True,
              help="llama-bench repetitions per test; starts of each engine for startup.")
@click.option("--weights", default="auto", show_default=True, help="edgeserve --weights (NumPy backend).")
@click.option("--activations", type=click.Choice(list(ACTIVATION_MODES)), default=None,
              help="edgeserve --activations: int8 is llama.cpp's own activation precision [default: edgeserve's].")
@click.option("--kv-memory", default="1GiB", show_default=True, help="edgeserve KV pool (64 x 256 tokens fit 1GiB).")
@click.option("--kv-dtype", type=click.Choice(["auto", *KV_DTYPES]), default="auto", show_default=True,
              help="edgeserve --kv-dtype (llama.cpp keeps its default, float16).")
@click.option("--probe-size", default=1 << 30, show_default=True, help="Bytes summed by the bandwidth probe.")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON on stdout.")
def main(model_name: str | None, llama_cpp: Path | None, only: str, streams: str, http_clients: int,
         http_requests: int, threads: int, repetitions: int, weights: str, activations: str | None, kv_memory: str,
         kv_dtype: str, probe_size: int, as_json: bool) -> None:
    """Benchmark edgeserve against llama.cpp's own tools on the same GGUF, same machine, same sitting."""
    parts = {p.strip() for p in only.split(",") if p.strip()}
    if unknown := parts - set(PARTS):
        raise click.UsageError(f"--only: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    if "bandwidth" in parts:
        parts.add("single")
    gguf = resolve_model(model_name)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5:
        console.print(f"[yellow]load average {load:.1f} on {usable_cores()} cores before starting: "
                      "other work running now makes every figure noisy (llama.cpp's spinning threads suffer most)")
    failures = []
    # The description keeps its width; the tool's latest line gets what is left of the terminal (run_tool).
    with Progress(SpinnerColumn(), TextColumn("{task.description}", table_column=Column(no_wrap=True, min_width=36)),
                  BarColumn(bar_width=12), TimeElapsedColumn(),
                  TextColumn("[dim]{task.fields[detail]}", table_column=Column(no_wrap=True)),
                  console=console) as progress:
        try:
            bin_dir = find_llama_cpp(llama_cpp) or build_llama_cpp(progress)
        except ToolError as exc:
            raise click.ClickException(f"no llama.cpp tools: {exc}") from exc
        progress.console.print(f"llama.cpp tools: {bin_dir}")
        bench = Bench(gguf, bin_dir, threads, weights, activations, kv_memory, kv_dtype, progress,
                      probe_size if "bandwidth" in parts else None)
        steps = {
            "single": lambda: bench.single(repetitions),
            "batched": lambda: bench.batched(parse_list(streams)),
            "http": lambda: bench.http(http_clients, http_requests),
            "bandwidth": bench.bandwidth,
            "startup": lambda: bench.startup(repetitions),
        }
        for part in PARTS:  # single before bandwidth, which uses its figures
            if part in parts:
                try:
                    steps[part]()
                except ToolError as exc:
                    failures.append(part)
                    progress.console.print(f"[red]{part} failed:[/] {escape(str(exc))}")
    results = {"model": str(gguf), "model_shape": model_shape(gguf), "threads": threads, "weights": weights,
               "activations": activations or DEFAULT_ACTIVATIONS, "kv_dtype": kv_dtype, **bench.results}
    results["rows"] = table_rows(results)
    print_table(results)
    if as_json:
        click.echo(json.dumps(results, indent=1))
    if failures:
        raise SystemExit(f"failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
