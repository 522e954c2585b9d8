"""The C ops of the CPU path (decode attention, RMSNorm, RoPE, SiLU gate, KV writes, the sampler's draws and
logprobs) against the numba kernel and the NumPy code they replace: every code path this CPU runs, one thread and the pool, ragged
batches whose contexts cross blocks, one row and many; and the fallback when the extension is
absent or an array's layout is one the C ops do not take."""

from __future__ import annotations

import numpy as np
import pytest

from edgeserve.backends import cpu_kernels, kv_formats, qmatmul
from edgeserve.backends.numpy_backend import NumpyBackend, NumpyMeta
from edgeserve.batch import random_paged_batch
from edgeserve.engine import sampler
from edgeserve.engine.constraints import MASKED_LOGIT
from edgeserve.engine.sequence import Sequence
from edgeserve.sampling_params import SamplingParams

ext = cpu_kernels.ops
needs_ext = pytest.mark.skipif(ext is None, reason="the C extension is not built (or EDGESERVE_QMATMUL=numba)")


@pytest.fixture(params=["generic", "avx2", "avx512vnni"])
def isa(request):
    """Each code path of the extension this CPU can run."""
    if ext is None:
        pytest.skip("the C extension is not built (or EDGESERVE_QMATMUL=numba)")
    try:
        ext.set_isa(request.param)
    except ValueError:
        pytest.skip(f"{request.param} is not available on this CPU")
    yield request.param
    ext.set_isa(None)


@pytest.fixture(params=[1, 2], ids=["1-thread", "pool"])
def threads(request, every_core):
    """One thread, and two: with one sequence the pool splits each KV head's keys into ranges."""
    yield qmatmul.set_num_threads(request.param)
    qmatmul.set_num_threads()


@pytest.fixture
def no_ext(monkeypatch):
    """The fallback: NumPy ops and the numba attention kernel, as where the extension is absent."""
    monkeypatch.setattr(cpu_kernels, "ops", None)


def attention_case(seed: int, block_size: int, n_kv: int, group: int, head_dim: int, lens: list[int]):
    """Decode queries, K/V pools, block tables (blocks scattered over the pool) and context lengths."""
    rng = np.random.default_rng(seed)
    batch, num_blocks = random_paged_batch(lens, [1] * len(lens), block_size, rng, spare_blocks=3)
    q = (rng.standard_normal((len(lens), n_kv * group, head_dim)) * 3.0).astype(np.float32)  # peaked softmax
    k = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    return q, k, v, batch.block_tables, np.asarray(lens, np.int64)


def numba_attention(q, k, v, tables, lens, window=0):
    out = np.empty_like(q)
    cpu_kernels._decode_attention(np.ascontiguousarray(q), k, v, tables, lens, np.float32(1 / np.sqrt(q.shape[-1])),
                                  window, out)
    return out


LENS = {
    "one row": [700],
    "one row, one key": [1],
    "ragged": [1, 15, 16, 17, 333, 1000, 2],
    "many rows": [int(n) for n in np.random.default_rng(7).integers(1, 900, 40)],
}


@pytest.mark.parametrize("block_size,n_kv,group,head_dim", [
    (16, 3, 3, 64), (16, 2, 7, 64), (8, 2, 8, 128), (32, 1, 16, 128), (16, 4, 1, 128), (16, 2, 2, 48), (7, 2, 3, 16),
])
# forty rows of long contexts over every shape: the full suite's share
@pytest.mark.parametrize("lens", [pytest.param(lens, id=name, marks=[pytest.mark.slow] if name == "many rows" else [])
                                  for name, lens in LENS.items()])
def test_attention_matches_numba(isa, threads, block_size, n_kv, group, head_dim, lens):
    q, k, v, tables, ctx = attention_case(block_size + group + head_dim, block_size, n_kv, group, head_dim, lens)
    out = np.full_like(q, np.nan)
    assert ext.attention(q, k, v, tables, ctx, out, 1 / np.sqrt(head_dim))
    np.testing.assert_allclose(out, numba_attention(q, k, v, tables, ctx), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 300, 512, 5000])
def test_attention_window_matches_numba_and_plain_attention(isa, threads, window):
    """Sliding-window layers: each row sees its last `window` keys, whether they start inside a
    block, at a block edge, or the row has fewer; long rows still split into ranges."""
    q, k, v, tables, ctx = attention_case(window, 16, 2, 2, 64, [1, 15, 16, 17, 333, 1000, 700, 2])
    out = np.full_like(q, np.nan)
    assert ext.attention(q, k, v, tables, ctx, out, 1 / np.sqrt(64), window)
    np.testing.assert_allclose(out, numba_attention(q, k, v, tables, ctx, window), atol=2e-5, rtol=0)
    batch = random_paged_batch([int(n) for n in ctx], [1] * len(ctx), 16, np.random.default_rng(0))[0]
    batch.block_tables = tables
    np.testing.assert_allclose(out, dense_causal_attention(q, k, v, batch, window), atol=2e-5, rtol=0)
    if window < 1000:
        assert np.abs(out[5] - numba_attention(q, k, v, tables, ctx)[5]).max() > 1e-3  # the window matters


def prompt_rows_case(seed: int, n_kv: int, group: int, head_dim: int, kv_dtype: str = "float32"):
    """A step of prompt chunks (their rows share a block table, one more key each: 40 rows crossing the
    256-key range edge, 20 rows from 490, a 3-row speculative check) and single decode rows between them."""
    rng = np.random.default_rng(seed)
    bs, rows = 16, []
    for context, n in [(120, 1), (275, 40), (33, 1), (510, 20), (700, 1), (9, 3)]:
        table = rng.permutation(64)[: (context + bs - 1) // bs]
        rows += [(table, context - n + 1 + i) for i in range(n)]
    tables = np.zeros((len(rows), 64), np.int64)
    for i, (table, _) in enumerate(rows):
        tables[i, : len(table)] = table
    q = (rng.standard_normal((len(rows), n_kv * group, head_dim)) * 3.0).astype(np.float32)
    k, v = (kv_formats.store(rng.standard_normal((64, bs, n_kv, head_dim)).astype(np.float32), kv_dtype)
            for _ in range(2))
    return q, k, v, tables, np.array([n for _, n in rows], np.int64)


def assert_rows_get_their_bits_alone(q, k, v, tables, ctx, window):
    """Each row of one attention call has the bits it gets in a call of its own, and numba's answer."""
    head_dim = q.shape[-1]
    out = np.full_like(q, np.nan)
    assert ext.attention(q, k, v, tables, ctx, out, 1 / np.sqrt(head_dim), window)
    for i in range(len(ctx)):
        alone = np.full_like(q[i : i + 1], np.nan)
        assert ext.attention(q[i : i + 1], k, v, tables[i : i + 1], ctx[i : i + 1], alone, 1 / np.sqrt(head_dim), window)
        np.testing.assert_array_equal(out[i : i + 1], alone, err_msg=f"row {i}, {ctx[i]} keys")
    want = numba_attention(q, kv_formats.load(k, head_dim), kv_formats.load(v, head_dim), tables, ctx, window)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("n_kv,group,head_dim,window", [(3, 3, 64, 0), (2, 4, 128, 0), (1, 16, 64, 0), (2, 2, 64, 300)])
def test_prompt_rows_give_each_rows_own_bits(isa, threads, kv_dtype, n_kv, group, head_dim, window):
    """A prompt's rows are run together (their keys copied once for all of them), and each row's output is
    the bits it gets alone: a prompt answers the same beside other requests, after a prefix hit or when its
    tokens come one at a time, and a speculative check gives the decode rows' logits."""
    q, k, v, tables, ctx = prompt_rows_case(head_dim + group, n_kv, group, head_dim, kv_dtype)
    assert_rows_get_their_bits_alone(q, k, v, tables, ctx, window)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("n_kv,group,head_dim,window", [(8, 4, 64, 0), (4, 2, 128, 0), (6, 1, 64, 100)])
def test_decode_rows_give_each_rows_own_bits(isa, threads, kv_dtype, n_kv, group, head_dim, window):
    """Many decode rows run their KV heads together, tile by tile (a row alone runs them head by head): each
    row still gets the bits it gets alone, and numba's answer."""
    lens = [int(n) for n in np.random.default_rng(n_kv).integers(1, 600, 24)]
    q, k, v, tables, ctx = attention_case(head_dim + group, 16, n_kv, group, head_dim, lens)
    k, v = (kv_formats.store(c, kv_dtype) for c in (k, v))
    assert_rows_get_their_bits_alone(q, k, v, tables, ctx, window)


@needs_ext
def test_attention_takes_query_rows_at_a_stride():
    """q as the backend passes it: the query heads of a [T, q + k heads, hd] array."""
    q, k, v, tables, ctx = attention_case(1, 16, 3, 3, 64, [40, 90, 7])
    qk = np.concatenate([q, np.ones((3, 3, 64), np.float32)], axis=1)
    got = cpu_kernels.decode_attention(qk[:, :9], k, v, tables, ctx)
    np.testing.assert_allclose(got, numba_attention(q, k, v, tables, ctx), atol=2e-5, rtol=0)


@needs_ext
def test_attention_zero_context_gives_zeros_and_bad_tables_raise():
    q, k, v, tables, ctx = attention_case(2, 16, 2, 2, 64, [5, 20])
    out = np.full_like(q, np.nan)
    assert ext.attention(q, k, v, tables, np.array([0, 20]), out, 0.125)
    assert not out[0].any()
    tables[1, 1] = len(k)
    with pytest.raises(ValueError, match="outside the pool"):
        ext.attention(q, k, v, tables, ctx, out, 0.125)
    with pytest.raises(ValueError, match="outside the pool"):
        ext.attention(q, k, v, tables, np.array([5, 16 * tables.shape[1] + 1]), out, 0.125)


@needs_ext
def test_attention_declines_other_layouts():
    q, k, v, tables, ctx = attention_case(3, 16, 2, 2, 64, [5, 20])
    out = np.empty_like(q)
    assert not ext.attention(q.astype(np.float64), k, v, tables, ctx, out, 0.125)
    assert not ext.attention(q, k, v, tables.astype(np.int32), ctx, out, 0.125)
    assert not ext.attention(q[:, :, ::2], k[..., ::2], v[..., ::2], tables, ctx, out[:, :, ::2], 0.125)
    # the wrapper then runs the numba kernel
    got = cpu_kernels.decode_attention(q, k, v, tables.astype(np.int32), ctx)
    np.testing.assert_allclose(got, numba_attention(q, k, v, tables, ctx), atol=2e-5, rtol=0)


def dense_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, batch, window: int | None = None) -> np.ndarray:
    """Plain softmax attention, one row at a time, over the keys up to each row's position (its last
    `window` of them where given)."""
    n_heads, hd = q.shape[1:]
    group = n_heads // k.shape[2]
    out = np.empty_like(q)
    seq_of_row = np.repeat(np.arange(batch.num_seqs), batch.query_lens)
    for row, (s, pos) in enumerate(zip(seq_of_row, batch.positions)):
        first = max(0, pos + 1 - window) if window else 0
        keys = k[batch.block_tables[s]].reshape(-1, *k.shape[2:])[first : pos + 1]
        values = v[batch.block_tables[s]].reshape(-1, *v.shape[2:])[first : pos + 1]
        for h in range(n_heads):
            scores = keys[:, h // group] @ q[row, h] / np.sqrt(hd)
            p = np.exp(scores - scores.max())
            out[row, h] = p @ values[:, h // group] / p.sum()
    return out


@pytest.mark.parametrize("window", [None, 20], ids=["causal", "window"])
def test_backend_attention_mixed_batch(isa, monkeypatch, window):
    """Decode rows and prefill chunks in one step: every row, C kernel or fallback, equals plain
    causal attention over its own sequence (or its window of it)."""
    rng = np.random.default_rng(5)
    contexts, query_lens = [300, 17, 64, 1, 250], [1, 17, 1, 1, 40]
    batch, num_blocks = random_paged_batch(contexts, query_lens, 16, rng, spare_blocks=2)
    q = rng.standard_normal((len(batch.positions), 9, 64)).astype(np.float32)
    k = rng.standard_normal((num_blocks, 16, 3, 64)).astype(np.float32)
    v = rng.standard_normal((num_blocks, 16, 3, 64)).astype(np.float32)
    be = NumpyBackend(weights="quantized")
    rope = (np.ones((400, 32), np.float32), np.zeros((400, 32), np.float32))
    got = be.paged_attention(q, k, v, be.batch_meta(batch, rope), window)
    want = dense_causal_attention(q, k, v, batch, window)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    monkeypatch.setattr(cpu_kernels, "ops", None)
    np.testing.assert_allclose(be.paged_attention(q, k, v, be.batch_meta(batch, rope), window), want, atol=2e-5,
                               rtol=0)


def small_meta(cos: np.ndarray, sin: np.ndarray) -> NumpyMeta:
    empty = np.zeros(0, np.int64)
    return NumpyMeta(empty, empty, empty, cos, sin, np.zeros((0, 0), np.int64), empty, empty)


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_small_ops_match_numpy(isa, threads, rows, monkeypatch):
    rng = np.random.default_rng(rows)
    be = NumpyBackend(weights="quantized")
    x = rng.standard_normal((rows, 576)).astype(np.float32) * 4
    w = rng.standard_normal(576).astype(np.float32)
    gate_up = rng.standard_normal((rows, 2 * 1536)).astype(np.float32) * 6
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -1e-30]  # exp's clamps and the far ends of silu
    qkv = rng.standard_normal((rows, 15, 64)).astype(np.float32)
    angles = rng.uniform(0, 100, (rows, 1, 32))
    meta = small_meta(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    # the backend passes RoPE the q and k heads of the fused qkv output: rows at a stride; 1531 gate columns
    # leave a tail past the last whole vector
    got = (be.rms_norm(x, w, 1e-5), be.rms_norm(x[:, :64], w[:64], 1e-5), be.silu_mul(gate_up),
           be.silu_mul(gate_up[:, :2 * 1531]), be.apply_rope(qkv[:, :12], meta))
    monkeypatch.setattr(cpu_kernels, "ops", None)
    with np.errstate(over="ignore"):  # NumPy's exp(100) in silu: inf, and silu 0 as it should be
        want = (be.rms_norm(x, w, 1e-5), be.rms_norm(x[:, :64], w[:64], 1e-5), be.silu_mul(gate_up),
                be.silu_mul(gate_up[:, :2 * 1531]), be.apply_rope(qkv[:, :12], meta))
    for g, e in zip(got, want):
        assert g.shape == e.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, e, rtol=2e-6, atol=2e-6)


@needs_ext
def test_small_ops_decline_other_layouts():
    x = np.ones((2, 8), np.float64)
    assert cpu_kernels.rms_norm(x, np.ones(8, np.float64), 1e-5) is None
    assert cpu_kernels.silu_mul(x) is None
    assert cpu_kernels.apply_rope(np.ones((2, 3, 8), np.float32)[:, :, ::2], np.ones((2, 2), np.float32),
                                  np.ones((2, 2), np.float32)) is None


@pytest.mark.parametrize("rows", [1, 300])
def test_write_kv_matches_numpy(monkeypatch, rows):
    rng = np.random.default_rng(rows)
    be = NumpyBackend(weights="quantized")
    qkv = rng.standard_normal((rows, 15, 64)).astype(np.float32)
    meta = small_meta(np.zeros(0, np.float32), np.zeros(0, np.float32))
    meta.slot_mapping = rng.permutation(40 * 16)[:rows]
    got = be.write_kv(np.zeros((40, 16, 3, 64), np.float32), qkv[:, 9:12], meta)  # the k heads: rows at a stride
    monkeypatch.setattr(cpu_kernels, "ops", None)
    np.testing.assert_array_equal(got, be.write_kv(np.zeros((40, 16, 3, 64), np.float32), qkv[:, 9:12], meta))


@needs_ext
def test_write_kv_declines_slots_outside_the_pool():
    cache = np.zeros((2, 4, 1, 8), np.float32)
    assert not cpu_kernels.write_kv(cache, np.ones((1, 1, 8), np.float32), np.array([8]))
    assert not cpu_kernels.write_kv(cache, np.ones((1, 1, 8), np.float32), np.array([-1]))
    assert not cache.any()


def test_fallback_when_extension_is_absent(no_ext):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert cpu_kernels.rms_norm(x, np.ones(64, np.float32), 1e-5) is None
    assert cpu_kernels.silu_mul(x) is None
    assert not cpu_kernels.write_kv(np.zeros((1, 4, 1, 64), np.float32), x[:, None], np.array([0, 1]))
    be = NumpyBackend(weights="float32")
    out = be.rms_norm(x, np.ones(64, np.float32), 1e-5)
    np.testing.assert_allclose(out, x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5), rtol=1e-5)
    q, k, v, tables, ctx = attention_case(4, 16, 3, 3, 64, [1, 100, 900, 17, 40])
    np.testing.assert_allclose(cpu_kernels.decode_attention(q, k, v, tables, ctx),
                               numba_attention(q, k, v, tables, ctx), atol=1e-6, rtol=0)


# the sampler's ops ---------------------------------------------------------------------------------


def logit_rows(seed: int) -> np.ndarray:
    """Rows of a vocabulary that is no multiple of 16: spread logits, a grammar's row, ties, a NaN, an inf."""
    x = (np.random.default_rng(seed).standard_normal((8, 49157)) * 4).astype(np.float32)
    x[2, 100:] = MASKED_LOGIT
    x[3, :] = 1.5
    x[4, 9] = np.nan
    x[5, 3] = np.inf
    x[6, :] = MASKED_LOGIT
    return x


def test_draws_pick_the_token_a_float64_cumulative_sum_picks(isa, threads):
    x = logit_rows(11)
    rows = np.array([7, 0, 2, 3, 4, 1, 5, 6], np.int64)
    inv_t = np.array([1 / 0.7, 1.0, 2.0, 1.0, 1 / 1.3, 10.0, 1.0, 1.0], np.float32)
    u = np.random.default_rng(12).random(len(rows))
    u[1] = 0.0
    token = np.full(len(rows), -7, np.int64)
    no_cut = np.zeros(len(rows), np.int32), np.ones(len(rows), np.float32), np.zeros(len(rows), np.float32)
    assert ext.sample_logits(x, rows, inv_t, *no_cut, u, token)
    for i, r in enumerate(rows[:6]):
        z = (x[r].astype(np.float64) - np.nanmax(x[r])) * inv_t[i]
        w = np.where(np.isnan(z), 0.0, np.exp(z))
        assert token[i] == np.searchsorted(np.cumsum(w) / w.sum(), u[i], side="right"), (i, r)
    assert token[2] < 100  # the grammar's row: an allowed token
    assert token[6] == -1 and token[7] == -1  # inf, and every token masked: left to the caller


def test_logit_stats_give_the_log_sum_exp_and_the_top_ids(isa, threads):
    x = logit_rows(13)
    rows = np.array([7, 0, 2, 3, 4, 1, 5], np.int64)
    norm, top = np.empty(len(rows)), np.empty((len(rows), 20), np.int64)
    assert ext.logit_stats(x, rows, norm, top)
    for i, r in enumerate(rows):
        z = x[r].astype(np.float64)
        finite = z[~np.isnan(z)]
        if np.isinf(finite).any():
            assert np.isnan(norm[i])
        else:
            assert norm[i] == pytest.approx(finite.max() + np.log(np.exp(finite - finite.max()).sum()), abs=1e-6)
        assert top[i].tolist() == np.argsort(-z, kind="stable")[:20].tolist()  # of equal logits the lower id


@pytest.mark.parametrize("params", [
    {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},  # the chat's defaults
    {"temperature": 1.0, "top_k": 40},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 1.2, "top_k": 50, "top_p": 0.8, "min_p": 0.01},
    {"temperature": 0.7, "top_p": 0.95, "frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {5: 3.0}},
    {"temperature": 0.5, "top_p": 0.5},
    {"temperature": 1.0, "top_p": 5e-324},  # 0 in float32: still the likeliest token, as NumPy's path keeps it
])
def test_cut_draws_give_the_numpy_path_s_token_for_the_same_seed(isa, params):
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((6, 49152)) * rng.uniform(1, 8, (6, 1))).astype(np.float32)
    x[0, 30:] = MASKED_LOGIT  # a grammar's row, penalties and bias included: no masked token comes back
    x[1] *= 0.05  # flat: top-p needs more of the row than the compiled op looks at
    history = list(range(100, 164)) + [5, 5, 7]
    compiled, left = 0, 0
    for seed in range(25):
        seqs = [Sequence(str(i), history, SamplingParams(seed=100 * seed + i, **params)) for i in range(6)]
        drawn = sampler._compiled_draws(x, seqs)
        for i in range(6):
            if i not in drawn:
                left += 1
                continue
            compiled += 1
            numpy_seq = Sequence(str(i), history, SamplingParams(seed=100 * seed + i, **params))
            assert drawn[i] == sampler.sample_row(x[i].copy(), numpy_seq), (seed, i)
            assert i != 0 or drawn[i] < 30
    assert compiled >= 100
    if 0.5 <= params.get("top_p", 1.0) < 1.0 and "top_k" not in params:
        assert left >= 25  # the flat row


def test_sampling_at_a_temperature_follows_the_distribution():
    logits = np.full((1, 1000), -20.0, np.float32)
    logits[0, :6] = [3.0, 2.5, 2.0, 1.0, 0.5, -1.0]
    seq = Sequence("s", [1], SamplingParams(temperature=0.7, seed=5))
    draws = np.bincount([sampler.sample(logits, [seq])[0][0] for _ in range(4000)], minlength=1000)
    p = np.exp(logits[0].astype(np.float64) / 0.7)
    p /= p.sum()
    assert np.allclose(draws / 4000, p, atol=0.025)
    again = Sequence("s", [1], SamplingParams(temperature=0.7, seed=5))
    assert [sampler.sample(logits, [again])[0][0] for _ in range(50)] == [
        int(np.searchsorted(np.cumsum(p) / p.sum(), u, side="right")) for u in np.random.default_rng(5).random(50)]
