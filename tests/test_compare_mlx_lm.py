"""bench/make_random_mlx.py and bench/compare_mlx_lm.py on the tiny shape: a folder edgeserve and mlx-lm both load,
and figures from both engines."""

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from bench_scripts import BENCH, load_script
from click.testing import CliRunner
from conftest import tiny_tokenizer

from edgeserve.models.loader import load_model

make_random_mlx = load_script("make_random_mlx")
compare = load_script("compare_mlx_lm")


@pytest.fixture(scope="module")
def tiny_mlx(tmp_path_factory) -> Path:
    """A tiny random model converted to 4 bits, over the character-level test tokenizer (ChatML tokens included)."""
    tmp = tmp_path_factory.mktemp("random-mlx")
    tiny_tokenizer(tmp / "tokenizer")
    out = tmp / "tiny-mlx"
    result = CliRunner().invoke(make_random_mlx.main,
                                ["--shape", "tiny", "--tokenizer", str(tmp / "tokenizer" / "tokenizer.json"),
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_a_random_mlx_folder_loads_in_edgeserve_and_mlx_lm(tiny_mlx):
    ours = load_model(str(tiny_mlx))
    assert ours.format == "mlx"
    assert (ours.args.hidden_size, ours.args.num_hidden_layers, ours.args.tie_word_embeddings) == (64, 2, True)
    assert "4-bit g64" in ours.quantization()
    assert ours.tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in ours.tokenizer.chat_template

    model, tokenizer = mlx_lm.load(str(tiny_mlx))
    logits = model(mx.array([tokenizer.encode("hello")]))
    assert logits.shape[-1] == ours.args.vocab_size
    assert mx.isfinite(logits).all().item()


def test_a_tokenizer_without_chatml_tokens_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    tiny_tokenizer(tmp_path / "src")
    vocab = json.loads((tmp_path / "src" / "tokenizer.json").read_text())
    vocab["added_tokens"] = [t for t in vocab["added_tokens"] if t["content"] != "<|im_start|>"]
    del vocab["model"]["vocab"]["<|im_start|>"]
    (tmp_path / "src" / "tokenizer.json").write_text(json.dumps(vocab))
    (tmp_path / "out").mkdir()
    with pytest.raises(make_random_mlx.click.ClickException, match=re.escape("no <|im_start|>")):
        make_random_mlx.write_tokenizer(tmp_path / "src", tmp_path / "out")


def test_the_decode_window_opens_when_the_last_stream_has_its_first_token():
    window = compare.DecodeWindow(["a", "b"])
    assert not window.step([("a", [1])])  # b is still prefilling
    assert window.step([("a", [2]), ("b", [7])])
    assert not window.step([("a", [3]), ("b", [8])])
    assert not window.step([("a", [4]), ("b", [9])])
    assert (window.tokens, window.steps, window.stream0) == (4, 2, [1, 2, 3, 4])
    assert window.figures(0.5).tokens_per_s == pytest.approx(4 / window.wall)
    assert not window.step([("a", [5, 6, 7]), ("b", [10, 11])])  # a burst of three decode steps, b finishing early
    assert (window.tokens, window.steps) == (9, 5)


def test_leading_agreement_stops_at_the_first_difference():
    assert compare.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert compare.leading_agreement(list(range(20)), list(range(20))) == compare.AGREE_TOKENS


def test_the_comparison_runs_both_engines_end_to_end(tiny_mlx):
    done = subprocess.run([sys.executable, str(BENCH / "compare_mlx_lm.py"), "--model", str(tiny_mlx),
                           "--streams", "1,2", "--tokens", "8", "--prompt-tokens", "16", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert results["dtype"] == ("float16" if mx.default_device().type == mx.DeviceType.gpu else "float32")
    assert str(mx.default_device()) in results["device"]
    assert [row["streams"] for row in results["rows"]] == [1, 2]
    for row in results["rows"]:
        for engine in ("mlx_lm", "ours"):
            figures = row[engine]
            assert figures["tokens_per_s"] > 0 and figures["host_ms_per_step"] > 0
            assert figures["steps"] == 7  # every token after the first, one step each
        assert row["ratio"] > 0
        assert 0 <= row["greedy_agree"] <= row["greedy_compared"] == 8
