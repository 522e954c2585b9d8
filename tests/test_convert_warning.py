"""`convert` says what a conversion costs without --report: a summary line (bits per weight, size), and a
warning from the weight errors where they are noticeable, above all when it re-quantizes quantized weights."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_folder import write_model_folder
from edgeserve.cli.convert_cmd import report_notice
from edgeserve.cli.main import cli
from edgeserve.evaluation.perplexity import windows
from edgeserve.evaluation.quality_report import model_perplexity
from edgeserve.evaluation.shipped_text import SHIPPED_TEXT
from edgeserve.system import usable_cores


def convert(*args: str):
    return CliRunner().invoke(cli, ["convert", *args])


@pytest.fixture
def float_folder(tiny_model, tmp_path: Path) -> Path:
    out = tmp_path / "float"
    write_model_folder(tiny_model, out)
    return out


def test_convert_summarises_and_warns_when_it_requantizes(float_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    once = convert(str(float_folder), "-o", str(tmp_path / "q4g32"), "--bits", "4", "--group-size", "32")
    assert once.exit_code == 0, once.output
    wrote = once.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'q4g32'))} \(4-bit, group 32(, \d+ matrices wider)?; "
                        r"\d+\.\d\d bits per weight, [\d.]+ [KM]iB\)", wrote), wrote
    assert "warning: matrices changed by" in once.stderr and "re-quantizing" not in once.stderr

    again = convert(str(tmp_path / "q4g32"), "-o", str(tmp_path / "q4g64"), "--bits", "4", "--group-size", "64")
    assert again.exit_code == 0, again.output
    assert "warning:" in again.stderr and "re-quantizing" in again.stderr

    kept = convert(str(tmp_path / "q4g32"), "-o", str(tmp_path / "same"), "--bits", "4", "--group-size", "32")
    assert "no loss to speak of" in kept.stderr and "warning" not in kept.stderr

    local = json.loads(CliRunner().invoke(cli, ["models", "--json"]).stdout)["local"]
    assert all("bits per weight" in m["detail"] and "layers." not in m["detail"] for m in local)


@pytest.mark.slow
def test_the_report_time_estimate_is_near_the_time_taken(loaded_model):
    """Perplexity over a few windows, in CPU time (the machine may be shared), against the notice's estimate
    of the same work: its seconds on every core."""
    notice = report_notice(loaded_model)
    estimate = re.search(r"roughly (\d+) (s|min)", notice)
    seconds = int(estimate[1]) * (60 if estimate[2] == "min" else 1)
    tokens = len(loaded_model.tokenizer.encode(SHIPPED_TEXT.read_text(encoding="utf-8")))
    count = 2 * len(windows(tokens, 512, 256))  # the notice covers source and result
    text = SHIPPED_TEXT.read_text(encoding="utf-8")[:6000]  # about 1.5k tokens: a few windows
    start = time.process_time()
    model_perplexity(loaded_model, text, 512, backend="numpy", progress=False)
    cpu_taken = time.process_time() - start
    measured_windows = len(windows(len(loaded_model.tokenizer.encode(text)), 512, 256))
    core_seconds_estimate = seconds / count * usable_cores() * measured_windows
    ratio = cpu_taken / core_seconds_estimate
    # one rate for every model and CPU, so "roughly" means within 4x either way: SmolLM2 135M on 2 cores measured
    # 0.63 against 1e10 before the vectorized gates, 0.4 after; against 2e10 0.38 on a fast-memory Xeon hour
    assert 0.25 < ratio < 4.0, (cpu_taken, core_seconds_estimate)
