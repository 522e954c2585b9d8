"""bench/compare_llamacpp.py's own parts that need no llama.cpp (a stand-in llama-bench where one runs): the
model's shape, timed starts, the single-stream rounds, the report."""

import json
import re
import sys

import pytest
from bench_scripts import load_script, write_tiny

compare = load_script("compare_llamacpp")


def test_the_report_names_the_model_shape_and_its_tensor_types(tmp_path, model_path):
    path = write_tiny(tmp_path / "tiny.gguf", "q4_k_m", model_path)
    shape = compare.model_shape(path)
    assert shape.startswith("llama: 8 layers, hidden 256, heads 4/2, MLP 512, vocab 49152; ")
    # the output head and half the ffn_down / attn_v are Q6_K, the rest Q4_K: shares by bytes, largest first
    assert re.search(r"; Q6_K \d+%, Q4_K \d+%; 0.02 GB$", shape)


def test_a_timed_process_reports_its_wall_time_and_peak_memory():
    wall, rss = compare.timed_process([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(0.3)"])
    assert 0.3 <= wall < 30
    assert rss >= 200 << 20


def test_a_timed_process_reports_its_own_peak_not_that_of_the_large_process_starting_it():
    held = bytearray(600 << 20)  # as the bandwidth probe's array grows the benchmark's own process
    held[:: 4096] = b"x" * len(held[:: 4096])  # every page touched, so resident
    _, rss = compare.timed_process([sys.executable, "-c", "b = bytearray(50 << 20)"])
    assert 50 << 20 <= rss < 300 << 20


def test_a_failing_process_is_a_tool_error_with_its_output():
    with pytest.raises(compare.ToolError, match="the reason"):
        compare.timed_process([sys.executable, "-c", "import sys; sys.exit('the reason')"])


def test_startup_rows_compare_seconds_and_memory_per_file_byte():
    results = {"startup": {"model_bytes": 1000, "edgeserve_first_s": 9.0, "edgeserve_first_peak_rss_bytes": 2500,
                           "edgeserve_s": 2.0, "edgeserve_peak_rss_bytes": 1100,
                           "llama_cpp_s": 1.0, "llama_cpp_peak_rss_bytes": 1050}}
    rows = {r["figure"]: r for r in compare.table_rows(results)}
    assert rows["start to 1st token s"]["ratio"] == 2.0
    assert rows["peak RSS / file size"]["edgeserve"] == 1.1 and rows["peak RSS / file size"]["llama_cpp"] == 1.05
    assert rows["peak RSS / file, first start"]["edgeserve"] == 2.5


def test_an_unknown_model_name_is_a_usage_error(tmp_path):
    with pytest.raises(compare.click.UsageError, match="not a catalog name"):
        compare.resolve_model(str(tmp_path / "missing.gguf"))


def test_the_server_runs_cold_as_llama_server_does(tmp_path):
    bench = compare.Bench(tmp_path / "m.gguf", tmp_path, 2, "auto", None, "1GiB", "auto", progress=None)
    command = bench.edgeserve_serve(8123)
    assert command[command.index("--prefix-cache-disk") + 1] == "0"
    assert command[-2:] == ["--port", "8123"] and "serve" in command


FAKE_LLAMA_BENCH = """#!{python}
import json, pathlib, sys
calls = pathlib.Path(sys.argv[0]).with_name("calls")
n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
rounds = [dict(pp=120.0, tg=45.0, deep=30.0), dict(pp=130.0, tg=40.0, deep=28.0)][n // 2]
def run(n_prompt, n_gen, ts):
    return dict(n_prompt=n_prompt, n_gen=n_gen, avg_ts=ts, stddev_ts=1.0, build_commit="abc", build_number=1,
                cpu_info="cpu")
if "-d" in sys.argv:
    print(json.dumps([run(0, 128, rounds["deep"])]))
else:
    print(json.dumps([run(512, 0, rounds["pp"]), run(0, 128, rounds["tg"])]))
"""


def test_single_stream_figures_are_the_best_of_rounds_the_engines_take_in_turn(tmp_path, monkeypatch):
    tool = tmp_path / "llama-bench"
    tool.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    tool.chmod(0o755)
    ours = iter([{"decode_empty_context_tokens_per_s": 42.0, "decode_tokens_per_s": 36.0, "prefill_tokens_per_s": 250.0,
                  "ttft_s": 1.0},
                 {"decode_empty_context_tokens_per_s": 41.0, "decode_tokens_per_s": 38.0, "prefill_tokens_per_s": 260.0,
                  "ttft_s": 2.0}])
    turns = []

    def edgeserve_bench(task, *args):
        turns.append(("edgeserve", int((tmp_path / "calls").read_text())))
        return {"single": next(ours)}

    bench = compare.Bench(tmp_path / "m.gguf", tmp_path, 2, "auto", None, "1GiB", "auto",
                          progress=compare.Progress(disable=True))
    monkeypatch.setattr(bench, "edgeserve_bench", edgeserve_bench)
    bench.single(repetitions=2)
    assert turns == [("edgeserve", 2), ("edgeserve", 4)]  # ours after each round of llama-bench's two calls
    single = bench.results["single"]
    assert single["llama_cpp"] == {"pp512_tokens_per_s": 130.0, "pp512_stddev": 1.0, "tg128_tokens_per_s": 45.0,
                                   "tg128_stddev": 1.0, "tg128_at_512_tokens_per_s": 30.0, "tg128_at_512_stddev": 1.0}
    assert single["edgeserve"] == {"decode_empty_context_tokens_per_s": 42.0, "decode_tokens_per_s": 38.0,
                                   "prefill_tokens_per_s": 260.0, "ttft_s": 2.0}
    rows = {r["figure"]: r["ratio"] for r in compare.table_rows(bench.results)}
    assert rows["decode tok/s, 1 stream (tg128)"] == compare.ratio(42.0, 45.0) < 1


def test_the_read_probe_is_the_best_of_the_sitting(tmp_path, monkeypatch):
    """single probes the bus after each engine's run; the share is taken against the fastest read of them all."""
    bench = compare.Bench(tmp_path / "m.gguf", tmp_path, 2, "auto", None, "1GiB", "auto",
                          progress=compare.Progress(disable=True), probe_size=8 << 20)
    with open(tmp_path / "m.gguf", "wb") as f:
        f.truncate(2 * 10**9)  # a sparse file: 2 GB read per token
    probed = []
    monkeypatch.setattr(bench, "read_probe", lambda: probed.append(len(probed)))
    monkeypatch.setattr(compare, "run_tool", lambda cmd, progress, task: json.dumps(
        [dict(n_prompt=p, n_gen=g, avg_ts=40.0, stddev_ts=1.0) for p, g in ((512, 0), (0, 128))]))
    monkeypatch.setattr(bench, "edgeserve_bench", lambda task, *args: {"single": {
        "decode_empty_context_tokens_per_s": 50.0, "decode_tokens_per_s": 45.0, "prefill_tokens_per_s": 200.0}})
    bench.single(repetitions=1)
    assert len(probed) == 2 * compare.SINGLE_ROUNDS
    monkeypatch.undo()
    bench.probes = {1: 1000.0, 2: 3.0}  # a read no machine makes, as if an earlier probe had seen it
    bench.bandwidth()
    bw = bench.results["bandwidth"]
    assert bw["read_GBps"] == 1000.0 and bw["read_GBps_1_threads"] == 1000.0
    assert 3.0 < bw["read_GBps_2_threads"] < 1000.0  # the fresh probe replaced the slower one
    assert bw["edgeserve_share"] == round(2.0 * 50.0 / 1000.0, 3)
