"""A model split across processes on mx.distributed: how layers, heads and memory split; a pipeline's stages
chained by hand give the whole model's logits; and, under `mlx.launch` over loopback, 2 and 3 ranks give one
rank's greedy tokens through a batch with prefix-cache hits and preemptions (on the default model's first layers),
and a rank killed mid-answer fails the answer and /health on rank 0 within seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from edgeserve.distributed.plan import kv_args, plan, split_range
from edgeserve.errors import EdgeserveError
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.models.loader import LoadedModel, load_model
from bench_scripts import patch_metadata
from serve_process import ServeProcess, Stream, free_port_run

mx = pytest.importorskip("mlx.core", reason="MLX is not installed: distributed serving not tested")

from edgeserve.backends.mlx_backend import MLXBackend  # noqa: E402
from edgeserve.distributed.group import decode, encode  # noqa: E402
from edgeserve.distributed.runner import MICRO_BATCH_ROWS, micro_batches  # noqa: E402
from edgeserve.engine.kv_budget import PoolSize, kv_bytes_per_token  # noqa: E402
from edgeserve.engine.model_runner import ModelRunner  # noqa: E402
from edgeserve.engine.scheduler import ScheduledSeq  # noqa: E402
from edgeserve.engine.sequence import Sequence  # noqa: E402
from edgeserve.sampling_params import SamplingParams  # noqa: E402

HERE = Path(__file__).parent
RANK_SCRIPT = HERE / "distributed_rank.py"
PROMPTS = [case["prompt_ids"] for case in
           json.loads((HERE / "fixtures" / "smollm2_transformers_reference.json").read_text())["cases"]]
BLOCK_SIZE, NUM_BLOCKS = 16, 7  # a pool too small for the batch at once: it preempts


def test_layers_split_evenly_or_by_weight() -> None:
    assert [len(r) for r in split_range(30, [1, 1, 1, 1])] in ([8, 7, 7, 8], [8, 8, 7, 7], [7, 8, 8, 7])
    assert split_range(30, [1, 1]) == [range(0, 15), range(15, 30)]
    assert split_range(10, [3, 1]) == [range(0, 8), range(8, 10)]  # by memory
    assert [len(r) for r in split_range(3, [100, 1, 1])] == [1, 1, 1]  # none empty
    with pytest.raises(EdgeserveError):
        split_range(2, [1, 1, 1])


def test_tensor_plan_shares_heads_and_mlp_columns(tiny_model) -> None:
    args = tiny_model.args  # 2 KV heads, MLP 128
    shares = plan(args, "tensor", 2)
    assert [s.kv_heads for s in shares] == [range(0, 1), range(1, 2)]
    assert [s.mlp for s in shares] == [range(0, 64), range(64, 128)]
    assert all(s.layers == range(args.num_hidden_layers) for s in shares)
    with pytest.raises(EdgeserveError, match="at most 2 ranks"):
        plan(args, "tensor", 3)
    # each rank's pool holds its share of a token's K/V; together, the whole model's
    assert sum(kv_bytes_per_token(kv_args(args, "tensor", s), "float32") for s in shares) == \
        kv_bytes_per_token(args, "float32")


def test_messages_round_trip() -> None:
    message = {"op": "forward", "blocks": [3, 1], "ids": np.arange(5, dtype=np.int64),
               "rows": np.ones((2, 3, 4), np.uint8), "empty": np.zeros((0,), np.int32)}
    back = decode(encode(message))
    assert back.keys() == message.keys() and back["op"] == "forward" and back["blocks"] == [3, 1]
    for name in ("ids", "rows", "empty"):
        assert back[name].dtype == message[name].dtype and np.array_equal(back[name], message[name])


def test_pipeline_stages_chained_give_the_whole_models_logits(tiny_model, mlx_on_cpu) -> None:
    """The residual stream handed from stage to stage by hand, as the ranks hand it over the ring."""
    pool = PoolSize(8, BLOCK_SIZE, 0)
    whole = ModelRunner(tiny_model, MLXBackend(), pool)
    stages = [ModelRunner(tiny_model, MLXBackend(), pool, layers) for layers in (range(0, 1), range(1, 2))]
    # the first stage holds no norm or head; the last no embedding (its head is the model's own, untied)
    assert stages[0].model.norm is stages[0].model.lm_head is stages[1].model.embed is None
    seq = Sequence("s", [5, 9, 12, 7, 3], SamplingParams(max_tokens=1))
    seq.block_table = [2]
    scheduled = [ScheduledSeq(seq, 5)]
    want = whole.run(scheduled)
    batch = stages[0].build_batch(scheduled)
    h = stages[0].model.forward(batch, stages[0].kv)
    got = stages[1].backend.to_numpy(stages[1].model.forward(batch, stages[1].kv, h=h))
    np.testing.assert_allclose(got, want, atol=1e-5)
    # each stage's pool holds its own layer's K/V at the same slots as the whole model's
    np.testing.assert_array_equal(stages[1].read_block_bytes([2])[:, :2], whole.read_block_bytes([2])[:, 2:])


def test_a_step_splits_into_micro_batches_of_whole_sequences_that_give_its_tokens(tiny_model, mlx_on_cpu) -> None:
    """Three decodes and a prefill chunk: two halves of whole sequences, each as the engine would batch it alone,
    whose logits together are the whole step's; a half that would read a block the other writes, or a step of
    too few rows, goes whole."""
    pool = PoolSize(16, BLOCK_SIZE, 0)
    split, whole = ModelRunner(tiny_model, MLXBackend(), pool), ModelRunner(tiny_model, MLXBackend(), pool)
    seqs = [Sequence(f"s{i}", [3 + i, 9, 12, 7, 30 + i], SamplingParams(max_tokens=4)) for i in range(3)]
    seqs.append(Sequence("p", list(range(40, 52)), SamplingParams(max_tokens=4)))
    for i, seq in enumerate(seqs):
        seq.block_table = [2 * i + 1]
    for runner in (split, whole):  # the decodes' prompts in the pool first, all but their last token
        runner.run([ScheduledSeq(seq, 4) for seq in seqs[:3]])
    for seq in seqs[:3]:
        seq.num_computed_tokens = 4
    scheduled = [ScheduledSeq(seq, 1 if i < 3 else 12) for i, seq in enumerate(seqs)]
    batch = whole.build_batch(scheduled)
    parts = micro_batches(batch)
    assert [len(p.token_ids) for p in parts] == [3, 12] and [p.num_seqs for p in parts] == [3, 1]
    assert parts[1].query_start.tolist() == [0, 12] and parts[1].logits_indices.tolist() == [11]
    want = whole.backend.to_numpy(whole.model.forward(batch, whole.kv))
    got = np.concatenate([split.backend.to_numpy(split.model.forward(part, split.kv)) for part in parts])
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the prefill's block is one a decode reads: one half would read what the other writes
    seqs[3].block_table = [seqs[0].block_table[0]]
    overlapping, small = whole.build_batch(scheduled), whole.build_batch(scheduled[:3])
    assert len(small.token_ids) < MICRO_BATCH_ROWS
    for step in (overlapping, small):
        parts = micro_batches(step)
        assert len(parts) == 1 and parts[0] is step


def test_info_says_how_the_layers_and_memory_split(model_path) -> None:
    from edgeserve.cli.main import cli

    result = CliRunner().invoke(cli, ["info", str(model_path), "--ranks", "3"])
    assert result.exit_code == 0, result.output
    assert "rank 0 of 3 (pipeline)  layers 0-9 and the embedding;" in result.output
    assert "rank 1 of 3 (pipeline)  layers 10-19;" in result.output
    assert "rank 2 of 3 (pipeline)  layers 20-29 and the norm and head;" in result.output
    assert "KV 7680 bytes/token (float16)" in result.output  # a third of 30 layers' 23040
    result = CliRunner().invoke(cli, ["info", str(model_path), "-n", "2", "--distributed", "tensor"])
    assert "rank 1 of 2 (tensor)  layers 0-29: KV heads 2, MLP columns 768-1535;" in result.output
    result = CliRunner().invoke(cli, ["info", str(model_path), "-n", "4", "--distributed", "tensor"])
    assert "at most 3 ranks" in result.output


# under mlx.launch: ranks over loopback ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_layers(model_path, tmp_path_factory) -> LoadedModel:
    """The default model cut to its first 6 layers (the loader reads the blocks llama.block_count names): its own
    weights, quantization, tied head and tokenizer, so that greedy tokens follow the context as the whole model's
    do (a random model's greedy tokens repeat one token), with a fifth of the layers to run; on MLX's CPU a step of
    all 30 took a second or more."""
    path = tmp_path_factory.mktemp("first-layers") / "first-layers.gguf"
    patch_metadata(model_path, path, "llama.block_count", 6)
    return load_model(str(path))


def _cases(mode: str, ranks: int, loaded_model: LoadedModel) -> dict:
    """Ends of the fixture prompts in one batch on a pool of NUM_BLOCKS blocks (on every rank, whatever its
    share of a block): a0-a3 start in one block each and outgrow it, so that some are preempted; c1 repeats c0's
    prompt a step later, and finds its first block in the prefix cache."""
    shares = plan(loaded_model.args, mode, ranks) if ranks > 1 else []
    per_token = max([kv_bytes_per_token(kv_args(loaded_model.args, mode, s), "float32") for s in shares],
                    default=kv_bytes_per_token(loaded_model.args, "float32"))
    requests = [[f"a{i}", ids[-14:], 5] for i, ids in enumerate(PROMPTS)]
    requests += [[f"c{i}", PROMPTS[1][-20:], 3] for i in range(2)]
    # the prefix store's RAM tier keeps what the pool evicts: block reads and writes through the group
    return {"model": str(loaded_model.source),
            "config": {"kv_memory": NUM_BLOCKS * BLOCK_SIZE * per_token, "block_size": BLOCK_SIZE,
                       "prefix_cache_ram": "16MiB"},
            "requests": requests, "arrivals": {"2": ["c1"]}}


def _sixteen_streams(loaded_model: LoadedModel) -> dict:
    """Sixteen ends of the fixture prompts at once on a pool that holds them all: every decode step has 16 rows, so
    a pipeline runs it as two micro-batches."""
    requests = [[f"s{i}", PROMPTS[i % len(PROMPTS)][-(4 + i % 4):], 4] for i in range(16)]
    return {"model": str(loaded_model.source), "config": {"kv_memory": "16MiB", "block_size": BLOCK_SIZE},
            "requests": requests}


def _launch(mode: str, ranks: int, loaded_model: LoadedModel, tmp_path: Path, cases: dict | None = None) -> dict:
    cases_path, out = tmp_path / f"cases-{mode}-{ranks}.json", tmp_path / f"out-{mode}-{ranks}.json"
    cases_path.write_text(json.dumps(cases or _cases(mode, ranks, loaded_model)))
    command = [sys.executable, str(RANK_SCRIPT), mode if ranks > 1 else "none", str(cases_path), str(out)]
    if ranks > 1:
        launcher = Path(sys.executable).with_name("mlx.launch")
        command = [str(launcher), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port_run(ranks)),
                   "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and out.exists(), done.stdout + done.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank(first_layers, tmp_path_factory) -> dict:
    return _launch("none", 1, first_layers, tmp_path_factory.mktemp("one-rank"))


@pytest.mark.parametrize("mode,ranks", [("pipeline", 2), ("pipeline", 3), ("tensor", 2)])
def test_ranks_give_one_ranks_greedy_tokens(mode, ranks, one_rank, first_layers, tmp_path) -> None:
    # the cases do what they are for
    assert one_rank["preemptions"] > 0 and one_rank["prefix_hit_tokens"] > 0 and one_rank["prefix_ram_hit_tokens"] > 0
    split = _launch(mode, ranks, first_layers, tmp_path)
    assert split == one_rank  # every request's tokens, and the same preemptions and prefix hits


@pytest.fixture(scope="module")
def one_rank_sixteen(first_layers, tmp_path_factory) -> dict:
    one = _launch("none", 1, first_layers, tmp_path_factory.mktemp("one-rank-16"), _sixteen_streams(first_layers))
    assert len(one["tokens"]) == 16 and one["preemptions"] == 0
    return one


@pytest.mark.parametrize("mode,ranks", [("pipeline", 2), ("pipeline", 3), ("tensor", 2)])
def test_sixteen_streams_give_one_ranks_greedy_tokens(mode, ranks, one_rank_sixteen, first_layers, tmp_path) -> None:
    """A pipeline runs each of these steps as two micro-batches; tensor ranks run them whole."""
    assert _launch(mode, ranks, first_layers, tmp_path, _sixteen_streams(first_layers)) == one_rank_sixteen


def test_a_rank_killed_mid_answer_fails_it_and_health_within_seconds(model_path, tmp_path) -> None:
    """The ranks started as mlx.launch starts them (which would then also stop rank 0: here it stays up to ask)."""
    hostfile = tmp_path / "hosts.json"
    first = free_port_run(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first}"], [f"127.0.0.1:{first + 1}"]]))
    args = ["--backend", "mlx", "--distributed", "pipeline", "--kv-memory", "64MiB", "--prefix-cache-disk", "0"]
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    rank1 = subprocess.Popen([sys.executable, "-m", "edgeserve.cli", "serve", "-m", str(model_path), *args],
                             env={**env, "MLX_RANK": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        server = ServeProcess(str(model_path), *args, env={"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0"})
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        stream = Stream(server.url, max_tokens=400)
        rank1.kill()
        killed = time.monotonic()
        stream.join()
        assert time.monotonic() - killed < 10
        assert stream.errors and "a rank of the group is gone" in stream.errors[0]["message"], stream.errors
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "a rank of the group is gone" in health.json()["error"]
    finally:
        rank1.kill()
        if server is not None:
            server.close()
