"""One bad request costs only its sender: seeds, extreme sampling values, failures in one row, a
sequence the pool cannot grow, and an engine thread that dies (issue 13, defects 1 to 3)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from edgeserve.cli.main import cli
from edgeserve.config import EngineConfig
from edgeserve.engine import sampler
from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.engine.output import RequestOutput
from edgeserve.engine.sequence import Sequence
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.app import create_app
from loopback import ServerThread

TINY_BYTES_PER_TOKEN = 512  # 2 x 2 layers x 2 KV heads x 16 dims x 4 bytes
PROMPT = [10 + i % 60 for i in range(40)]
MAX_STEPS = 2000  # far more than any request here needs: a request still running after it hangs
http = httpx.Client(timeout=30)  # a request that hangs fails the test instead of stalling it


def make_engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(backend="numpy", **{"kv_memory": "16MiB", **kw}))


def run_bounded(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Every output by request id, stepping at most MAX_STEPS times."""
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests still running after MAX_STEPS steps")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def sampled(seed: int | None, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=temperature, seed=seed, ignore_eos=True, **kw)


# defect 1: seeds and per-request failures -------------------------------------------------------

def test_any_int64_seed_seeds_a_generator(tiny_model):
    for seed in (-1, -(2**63), 2**63 - 1, 0):
        Sequence("s", [5], sampled(seed))
    assert Sequence("s", [5], sampled(7)).rng.random() == np.random.default_rng(7).random()  # unchanged
    engine = make_engine(tiny_model)
    engine.add_request(PROMPT, sampled(-1), "a")
    engine.add_request(PROMPT, sampled(-1), "b")
    outs = run_bounded(engine)
    assert tokens(outs["a"]) == tokens(outs["b"]) and len(tokens(outs["a"])) == 8


def test_a_request_that_cannot_start_fails_alone(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    real = engine.tokenize_prompt
    monkeypatch.setattr(engine, "tokenize_prompt",
                        lambda p: (_ for _ in ()).throw(ValueError("boom")) if p == "bad" else real(p))
    aengine = AsyncEngine(engine)

    async def both() -> tuple[BaseException | None, int]:
        with pytest.raises(EdgeserveError, match="boom") as failed:
            async for _ in aengine.generate("bad", sampled(1)):
                pass
        good = [t async for out in aengine.generate(PROMPT, sampled(1)) for t in out.token_ids]
        return failed.value, len(good)

    try:
        _, n = asyncio.run(asyncio.wait_for(both(), 30))
        assert n == 8 and aengine.alive
    finally:
        aengine.shutdown()


@pytest.fixture
def server(tiny_model) -> Iterator[tuple[LLMEngine, AsyncEngine, str]]:
    engine = make_engine(tiny_model)
    aengine = AsyncEngine(engine)
    srv = ServerThread(create_app(aengine, "tiny"))
    yield engine, aengine, srv.url
    srv.stop()
    aengine.shutdown()


def chat(url: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return http.post(url + "/v1/chat/completions", json=body)


def test_a_negative_seed_is_served_and_the_server_stays_up(server):
    _, _, url = server
    for seed in (-1, -(2**63)):
        r = chat(url, seed=seed, temperature=1)
        assert r.status_code == 200, r.text
    assert http.get(url + "/health").json()["status"] == "ok"
    assert chat(url).status_code == 200


def test_a_dead_engine_thread_fails_requests_fast_and_health_says_so(server, monkeypatch):
    engine, aengine, url = server

    def broken() -> bool:
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(engine, "has_unfinished", broken)
    aengine._wake.set()
    aengine._thread.join(timeout=10)
    assert not aengine.alive and "injected engine fault" in aengine.error
    health = http.get(url + "/health")
    assert health.status_code == 503 and "injected engine fault" in health.json()["error"]
    assert chat(url).status_code >= 500  # at once, not after the client's timeout
    with http.stream("POST", url + "/v1/chat/completions",
                     json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        body = r.read()
    assert r.status_code >= 500 or b"injected engine fault" in body


def test_run_with_a_negative_seed(tiny_model, monkeypatch):
    monkeypatch.setattr("edgeserve.models.loader.load_model", lambda _: tiny_model)
    done = CliRunner().invoke(cli, ["run", "--backend", "numpy", "--kv-memory", "16MiB", "--seed", "-1",
                                    "--temperature", "1", "--max-tokens", "4", "hi"])
    assert done.exit_code == 0, done.output
    assert done.exception is None


# defect 2: extreme sampling values fail nobody ------------------------------------------------

@pytest.mark.parametrize("extreme", [{"temperature": 1e-320}, {"repetition_penalty": 1e-320},
                                     {"temperature": 1e-300, "repetition_penalty": 1e-320}])
def test_extreme_sampling_values_fail_nobody(tiny_model, extreme):
    engine = make_engine(tiny_model)
    engine.add_request(PROMPT, sampled(3), "normal")
    engine.add_request(PROMPT, sampled(4, **extreme), "extreme")
    outs = run_bounded(engine)
    for rid in ("normal", "extreme"):
        assert outs[rid][-1].error is None and outs[rid][-1].finish_reason == "length"
        assert len(tokens(outs[rid])) == 8
    alone = make_engine(tiny_model)
    alone.add_request(PROMPT, sampled(3), "normal")
    assert tokens(run_bounded(alone)["normal"]) == tokens(outs["normal"])


def test_tiny_temperature_is_greedy(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request(PROMPT, sampled(1, temperature=1e-320), "tiny")
    engine.add_request(PROMPT, sampled(None, temperature=0.0), "greedy")
    outs = run_bounded(engine)
    assert tokens(outs["tiny"]) == tokens(outs["greedy"])


def test_a_row_that_fails_sampling_or_output_fails_alone(tiny_model, monkeypatch):
    real_row, real_draws = sampler.sample_row, sampler._compiled_draws

    def row(logits: np.ndarray, seq: Sequence) -> int:
        if seq.request_id == "bad-sample":
            raise ValueError("probabilities contain NaN")
        return real_row(logits, seq)

    def draws(logits: np.ndarray, seqs: list[Sequence]) -> dict[int, int]:  # the batch's draw fails with it
        if any(seq.request_id == "bad-sample" for seq in seqs):
            raise ValueError("probabilities contain NaN")
        return real_draws(logits, seqs)

    monkeypatch.setattr(sampler, "sample_row", row)
    monkeypatch.setattr(sampler, "_compiled_draws", draws)
    engine = make_engine(tiny_model)
    real_process = engine.output.process

    def process(seq: Sequence, token: int, logits_row: np.ndarray, grammar_complete: bool) -> RequestOutput:
        if seq.request_id == "bad-output":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_process(seq, token, logits_row, grammar_complete)

    monkeypatch.setattr(engine.output, "process", process)
    for rid in ("good", "bad-sample", "bad-output"):
        engine.add_request(PROMPT, sampled(5), rid)
    outs = run_bounded(engine)
    assert outs["good"][-1].error is None and len(tokens(outs["good"])) == 8
    assert "NaN" in outs["bad-sample"][-1].error and outs["bad-sample"][-1].finished
    assert "invalid start byte" in outs["bad-output"][-1].error and outs["bad-output"][-1].finished
    assert engine.request_ids() == [] and engine.block_manager.usage().used == 0


# defect 3: a sequence the pool cannot grow -----------------------------------------------------

def test_a_sequence_longer_than_the_pool_finishes_with_length(tiny_model):
    engine = make_engine(tiny_model, kv_memory=4 * 16 * TINY_BYTES_PER_TOKEN)  # 64 tokens
    assert engine.max_model_len == 64
    engine.add_request(PROMPT, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), "long")
    outs = run_bounded(engine)["long"]
    assert outs[-1].finish_reason == "length" and len(tokens(outs)) == 64 - len(PROMPT)
    assert engine.block_manager.usage().used == 0


def test_start_up_says_when_the_pool_caps_the_context(tiny_model, monkeypatch, capsys):
    from edgeserve.cli.options import build_engine

    monkeypatch.setattr("edgeserve.models.loader.load_model", lambda _: tiny_model)
    asked = tiny_model.args.max_position_embeddings  # -c asks for more than the pool holds
    build_engine("tiny", EngineConfig(backend="numpy", kv_memory=4 * 16 * TINY_BYTES_PER_TOKEN, max_model_len=asked))
    assert "max_model_len capped to 64 tokens" in capsys.readouterr().err
    build_engine("tiny", EngineConfig(backend="numpy", kv_memory="16MiB", max_model_len=asked))
    assert "capped" not in capsys.readouterr().err
