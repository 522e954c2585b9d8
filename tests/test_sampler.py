"""The sampler's filters and draw against plain full-vocabulary references."""

import numpy as np
import pytest

from edgeserve.engine.constraints import MASKED_LOGIT
from edgeserve.engine.sampler import LOGIT_LIMIT, apply_penalties, keep_top_p, sample, sample_row, token_logprobs
from edgeserve.engine.sequence import Sequence
from edgeserve.sampling_params import SamplingParams


def test_penalties_take_each_token_once_for_repetition_and_by_its_count_for_frequency():
    params = SamplingParams(repetition_penalty=2.0, repeat_last_n=4, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={7: 1.0})
    seq = Sequence("r", [1, 2, 3, 3], params)
    seq.token_ids += [3, 5, 5, 5]  # the output: 3 once, 5 three times; the last four tokens 3, 5, 5, 5
    logits = np.arange(-4.0, 4.0)  # token t's logit is t - 4
    want = logits.copy()
    want[7] += 1.0
    want[3] *= 2.0  # repeated and negative: multiplied, once however often it repeats
    want[5] /= 2.0  # repeated and positive: divided
    want[3] -= 0.5 * 1 + 0.25
    want[5] -= 0.5 * 3 + 0.25
    np.testing.assert_allclose(apply_penalties(logits.copy(), seq), want)
    params.repeat_last_n = -1  # the whole prompt and output: 1 and 2 too
    want[1] *= 2.0
    want[2] *= 2.0
    np.testing.assert_allclose(apply_penalties(logits.copy(), seq), want)


def reference_top_p(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest set of most likely tokens reaching top_p of the total, by a full sort."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    return set(order[: np.searchsorted(cum, top_p * probs.sum()) + 1].tolist())


@pytest.mark.parametrize("shape", ["peaked", "flat", "uniform"])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_same_set_as_a_full_sort(shape, top_p):
    rng = np.random.default_rng(hash((shape, top_p)) % 2**32)
    scale = {"peaked": 4.0, "flat": 0.3, "uniform": 0.0}[shape]
    probs = np.exp(rng.standard_normal(49152) * scale)
    if shape == "uniform":  # ties everywhere: only the set's size is defined
        probs = np.ones(49152)
    expected = reference_top_p(probs, top_p)
    kept = probs.copy()
    keep_top_p(kept, top_p)
    got = set(np.flatnonzero(kept).tolist())
    if shape == "uniform":
        assert len(got) == len(expected)
    else:
        assert got == expected
    assert np.array_equal(kept[list(got)], probs[list(got)])


def test_draws_follow_the_filtered_distribution():
    logits = np.full(1000, -20.0, np.float32)
    logits[:6] = [3.0, 2.5, 2.0, 1.0, 0.5, -1.0]
    params = SamplingParams(temperature=0.7, top_k=5, min_p=0.05, seed=3)
    seq = Sequence("s", [1], params)
    draws = np.bincount([sample_row(logits.copy(), seq) for _ in range(4000)], minlength=1000)
    p = np.exp(logits[:5].astype(np.float64) / 0.7)
    p /= p.sum()
    p[p < 0.05 * p.max()] = 0.0
    p /= p.sum()
    assert draws[5:].sum() == 0
    assert np.allclose(draws[:5] / 4000, p, atol=0.025)


def test_a_row_with_every_token_masked_fails_alone():
    masked = np.full(64, -LOGIT_LIMIT, np.float32)
    free = np.zeros(64, np.float32)
    free[7] = 5.0
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=1.0, seed=i)) for i in range(2)]
    tokens, failed = sample(np.stack([masked, free]), seqs)
    assert list(failed) == [0] and "no token is allowed" in failed[0]
    assert 0 <= tokens[1] < 64


def test_logprobs_of_a_batch_match_a_float64_log_softmax_row_by_row():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, 49152)) * 4).astype(np.float32)
    logits[2, 100:] = MASKED_LOGIT  # a grammar's row: only the first 100 tokens allowed
    logits[3, :] = logits[3, 0]  # ties everywhere
    tokens, tops = [7, 11, 50, 3, 0, 49151], [20, 0, 5, 4, 1, 20]
    entries = token_logprobs(logits, tokens, tops)
    for row, (entry, token, top) in enumerate(zip(entries, tokens, tops)):
        x = logits[row].astype(np.float64)
        reference = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert entry["token"] == token and entry["logprob"] == pytest.approx(reference[token], abs=1e-6)
        ids = [t for t, _ in entry["top"]]
        assert len(ids) == top and len(set(ids)) == top
        assert [lp for _, lp in entry["top"]] == pytest.approx(sorted(reference[ids], reverse=True), abs=1e-6)
        if row != 3:  # the likeliest, in order (with ties everywhere, any of them)
            assert ids == np.argsort(-reference, kind="stable")[:top].tolist()
