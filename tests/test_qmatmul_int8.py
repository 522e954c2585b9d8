"""The int8-activation kernels against a NumPy reference of the same arithmetic, and the kernels' limits."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgeserve.backends import qmatmul as qm
from edgeserve.backends.numpy_backend import NumpyBackend
from edgeserve.quant.affine import QuantizedTensor, quantize, unpack
from edgeserve.quant.kquants import KQuantTensor
from test_kquants import random_kquant
from test_qmatmul import ISAS

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(qm._ext is None, reason="C extension not built")
# row counts: one, the register tiles' edges (4 rows on AVX2), past one row tile of 64
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 67)


@pytest.fixture(params=ISAS)
def int8_isa(request):
    """Each C code path with int8 activations, restored to the defaults afterwards."""
    before = qm.get_activations()
    qm._ext.set_isa(request.param)
    qm.set_activations("int8")
    yield request.param
    qm.set_activations(before)
    qm._ext.set_isa(None)


def _integer_form(w: QuantizedTensor | KQuantTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Unsigned integers q [N, K] and float32 scale, bias [N, K / group]: w = scale * q + bias per group."""
    if isinstance(w, QuantizedTensor):
        q = unpack(w.weight, w.bits)
        return q, w.scales.astype(np.float32), w.biases.astype(np.float32), w.group_size
    p = w.planes()
    per_super = 256 // w.group_size
    scale = np.repeat(p.d, per_super, axis=1) * p.sc.astype(np.float32)
    bias = np.repeat(p.dmin, per_super, axis=1) * (p.sc if p.m is None else p.m).astype(np.float32)
    return p.q, scale, bias, w.group_size


def super_block_activations(isa: str, w: QuantizedTensor | KQuantTensor) -> bool:
    """Whether the kernels scale this product's activations per super-block of 256 (the AVX2 path of
    K-quants) rather than per weight group."""
    return isa != "generic" and isinstance(w, KQuantTensor)


def int8_reference(x: np.ndarray, w: QuantizedTensor | KQuantTensor,
                   super_block: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """x @ W.T as the int8 kernels compute it, and a bound on its float rounding.

    Each group of x becomes int8 q_x = rint(x * (127 / max|x|)) in float32, with d_x = max|x| / 127;
    a group adds scale * d_x * sum(q * q_x) (an exact integer dot) + bias * sum(x). With `super_block`
    the max and d_x are a super-block's (256 values) and sum(x) is d_x * sum(q_x)."""
    q, scale, bias, group = _integer_form(w)
    r, k = x.shape
    span = 256 if super_block else group
    xs = x.reshape(r, -1, span)
    amax = np.abs(xs).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(xs * inv[:, :, None]).astype(np.int64).reshape(r, -1, group)
    dots = np.einsum("rgk,ngk->rng", xq, q.reshape(len(q), -1, group).astype(np.int64))
    dx = np.repeat((amax / np.float32(127)).astype(np.float64), span // group, axis=1)
    xg = x.reshape(r, -1, group)
    sums = dx * xq.sum(axis=2) if super_block else xg.sum(axis=2, dtype=np.float64)
    terms = scale.astype(np.float64)[None] * dx[:, None] * dots + bias.astype(np.float64)[None] * sums[:, None]
    # float32 rounding: a few roundings per group's term, the running sum over groups, and sum(x)
    # summed in float32 over the group
    eps = 2.0**-23
    abs_sums = np.abs(xg).sum(axis=2, dtype=np.float64)
    bias_sums = abs_sums @ np.abs(bias).T.astype(np.float64)
    slack = eps * ((terms.shape[2] + 3) * np.abs(terms).sum(axis=2) + group * bias_sums)
    return terms.sum(axis=2), slack


def _check(x: np.ndarray, w: QuantizedTensor | KQuantTensor, m: qm.QMatrix, isa: str = "generic") -> None:
    got = qm.qmatmul(x, m)
    ref, slack = int8_reference(x, w, super_block_activations(isa, w))
    bad = np.abs(got - ref) > slack
    assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off, worst {np.abs(got - ref).max():.3g}"


def _affine(rng: np.random.Generator, n: int, k: int, bits: int, group: int, f16: bool) -> QuantizedTensor:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize(w.astype(np.float16) if f16 else w, group, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("f16", [True, False])
def test_affine_groups(int8_isa, bits, group, f16):
    rng = np.random.default_rng(bits * 1000 + group)
    # 8-bit weights span 0..255 (a Q8_0 block is q + 128): the signed-flip path must hold them all
    w = _affine(rng, 37, 4 * group, bits, group, f16)
    assert bits == 4 or int(unpack(w.weight, 8).max()) > 200
    m = qm.prepare([w])
    for rows in ROWS:
        _check(rng.standard_normal((rows, w.shape[1])).astype(np.float32), w, m)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quants(int8_isa, qtype):
    rng = np.random.default_rng(int(qtype))
    w = random_kquant(rng, qtype, 37, 512)
    m = qm.prepare([w])
    for rows in ROWS:
        _check(rng.standard_normal((rows, 512)).astype(np.float32), w, m, int8_isa)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0])
def test_a_row_alone_equals_it_in_a_batch(int8_isa, qtype):
    """Bit for bit, whatever the batch around it: a greedy answer does not change with the batch
    (or with speculative decoding's extra rows)."""
    rng = np.random.default_rng(int(qtype) + 7)
    if qtype in (T.Q8_0, T.Q4_0):
        w = _affine(rng, 40, 512, 8 if qtype == T.Q8_0 else 4, 32, True)
    else:
        w = random_kquant(rng, qtype, 40, 512)
    m = qm.prepare([w])
    x = rng.standard_normal((9, 512)).astype(np.float32)
    batch = qm.qmatmul(x, m)
    for r in (0, 5, 8):
        np.testing.assert_array_equal(qm.qmatmul(x[r : r + 1], m), batch[r : r + 1])


@pytest.mark.parametrize("n, k, group", [(1, 32, 32), (15, 96, 32), (17, 160, 32), (33, 64, 64), (200, 96, 32)])
def test_ragged_shapes(int8_isa, n, k, group):
    """N not a multiple of the panel's 16 columns, K not a multiple of any tile, zero rows of x."""
    rng = np.random.default_rng(n + k)
    for bits in (4, 8):
        w = _affine(rng, n, k, bits, group, True)
        m = qm.prepare([w])
        for rows in (1, 3, 6, 67):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            x[0, :group] = 0  # a group of zeros: scale 0, no division
            _check(x, w, m)


def test_int8_close_to_float(int8_isa):
    """The int8 path stays within its rounding of x @ W.T: each x moves by at most max|x| / 254 in its group."""
    rng = np.random.default_rng(3)
    w = _affine(rng, 64, 256, 4, 32, True)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ref = x @ w.dequantize().T
    step = np.repeat(np.abs(x).reshape(5, -1, 32).max(axis=2), 32, axis=1) / 254
    tol = step @ np.abs(w.dequantize()).T + 1e-5 * (np.abs(x) @ np.abs(w.dequantize()).T)
    assert (np.abs(qm.qmatmul(x, qm.prepare([w])) - ref) <= tol).all()


def test_backend_and_environment_choose_the_mode():
    before = qm.get_activations()
    try:
        backend = NumpyBackend(weights="quantized", activations="int8")
        assert qm.get_activations() == "int8" and "int8 activations" in backend.describe()
    finally:
        qm.set_activations(before)
    code = "from edgeserve.backends import qmatmul; print(qmatmul.get_activations())"
    for value, mode in (("int16", "int16"), (None, "int8")):  # int8 where nothing is said
        env = {k: v for k, v in os.environ.items() if k != "EDGESERVE_ACTIVATIONS"}
        env.update({"EDGESERVE_ACTIVATIONS": value} if value else {})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == mode


def test_activation_mode_is_checked():
    with pytest.raises(ValueError, match="activations"):
        qm.set_activations("int4")
    with pytest.raises(ValueError, match="8 or 16"):
        qm._ext.set_activation_bits(12)


@pytest.mark.parametrize("bits, group, fits", [(8, 256, True), (8, 512, False), (4, 4096, True), (4, 8192, False)])
def test_int32_accumulator_limit_is_checked_in_c(bits, group, fits):
    """int16 activations: a group's dot must fit int32, (2^bits - 1) * 32767 * group < 2^31."""
    n, k = 16, group
    packed, scales, biases = (np.zeros((1, k * bits // 32, 16), np.uint32), np.zeros((1, 1, 16), np.float16),
                              np.zeros((1, 1, 16), np.float16))
    x, out = np.ones((1, k), np.float32), np.empty((1, n), np.float32)
    if fits:
        qm._ext.gemm(x, packed, scales, biases, out, n, bits, group, True)
    else:
        with pytest.raises(ValueError, match="int32"):
            qm._ext.gemm(x, packed, scales, biases, out, n, bits, group, True)


@pytest.mark.skipif("avx512vnni" not in ISAS or "avx2" not in ISAS, reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, "affine4-64", "affine8-128"])
def test_avx512_equals_avx2_bit_for_bit(qtype):
    """The AVX-512 int8 kernels take the AVX2 ones' integer dots and float order: the same bits, at
    every row count (one row's two dependency chains, the four-row tiles and their remainders), with the
    K-quants' high bits placed by VBMI where the CPU has it and by shifts."""
    rng = np.random.default_rng(17)
    if isinstance(qtype, str):
        bits, group = (int(v) for v in qtype.removeprefix("affine").split("-"))
        w = _affine(rng, 45, 512, bits, group, False)
    elif qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        w = _affine(rng, 45, 512, 8 if qtype == T.Q8_0 else 4, 32, True)
    else:
        w = random_kquant(rng, qtype, 45, 512)
    m = qm.prepare([w])
    x = rng.standard_normal((67, 512)).astype(np.float32)
    before = qm.get_activations()
    qm.set_activations("int8")
    try:
        for rows in (1, 2, 3, 4, 5, 8, 67):
            got = {}
            for isa in ("avx2", "avx512vnni", "avx512vnni-novbmi"):
                qm._ext.set_isa(isa)
                got[isa] = qm.qmatmul(x[:rows], m)
            np.testing.assert_array_equal(got["avx512vnni"], got["avx2"])
            np.testing.assert_array_equal(got["avx512vnni-novbmi"], got["avx2"])
    finally:
        qm.set_activations(before)
        qm._ext.set_isa(None)
