"""Quantized matmul kernels against the dequantized float32 reference, on every storage type and path."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgeserve.backends import qmatmul as qm
from edgeserve.quant.affine import QuantizedTensor, quantize
from edgeserve.quant.gguf_blocks import _AFFINE_MAPPERS, SymmetricBlocks

ROWS = (1, 3, 16, 64, 300)


def _isas() -> list[str]:
    """Every C code path this CPU runs (the best one last, so it stays selected afterwards)."""
    if qm._ext is None:
        return []
    found = []
    for isa in ("generic", "avx2", "avx512vnni"):
        try:
            qm._ext.set_isa(isa)
            found.append(isa)
        except ValueError:
            pass
    qm._ext.set_isa(None)
    return found


ISAS = _isas()
IMPLS = [*(f"c/{isa}" for isa in ISAS), "numba"]


def _tensor(rng, n: int, k: int, bits: int, group: int, scales: str) -> QuantizedTensor:
    """A random quantized [n, k] matrix with float16, float32 or bfloat16 scales and biases."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    t = quantize(w.astype(np.float16) if scales == "f16" else w, group, bits)
    if scales == "bf16":  # bfloat16 as MLX folders store it: the top half of the float32 bits
        to_bf16 = lambda a: (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
        t = QuantizedTensor(t.weight, to_bf16(t.scales), to_bf16(t.biases), bits, group)
    return t


def _check(got: np.ndarray, x: np.ndarray, w: np.ndarray, kind: str, group: int) -> None:
    """Compare with x @ w.T within the error the kernel's arithmetic allows.

    Both paths sum float32 products in their own order (2e-5 of sum |x||w| covers K up to
    thousands). The C path also rounds x to int16 per weight group: each element moves by at most
    max|x in its group| / 65534, so the output by at most that, weighted by |w|.
    """
    ref = x @ w.T
    tol = 2e-5 * (np.abs(x) @ np.abs(w).T) + 1e-7
    if kind == "c":
        amax = np.abs(x).reshape(len(x), -1, group).max(axis=2)
        step = np.repeat(amax, group, axis=1) / 65534
        tol += 1.01 * (step @ np.abs(w).T)
    assert got.shape == ref.shape and got.dtype == np.float32
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{bad.sum()} outputs off, worst {np.abs(got - ref).max():.3g}"


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scales", ["f16", "f32", "bf16"])
def test_parity_every_storage_type(impl, bits, group, scales):
    rng = np.random.default_rng(bits * 1000 + group)
    # 37 columns: two full panels of 16 and a ragged one
    t = _tensor(rng, 37, 3 * group, bits, group, scales)
    m = qm.prepare([t])
    w = t.dequantize()
    for rows in ROWS:
        x = rng.standard_normal((rows, 3 * group)).astype(np.float32)
        _check(qm.qmatmul(x, m, impl=impl), x, w, impl, group)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("n, k, group", [(1, 32, 32), (15, 128, 128), (16, 64, 64), (17, 32, 32), (200, 96, 32)])
def test_odd_shapes(impl, n, k, group):
    rng = np.random.default_rng(n + k)
    for bits in (4, 8):
        t = _tensor(rng, n, k, bits, group, "f16")
        m = qm.prepare([t])
        for rows in (1, 7, 65):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            _check(qm.qmatmul(x, m, impl=impl), x, t.dequantize(), impl, group)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_other_widths_are_repacked_exactly(impl):
    rng = np.random.default_rng(5)
    for bits in (2, 3, 5, 6):
        t = _tensor(rng, 24, 64, bits, 64, "f32")
        m = qm.prepare([t])
        assert m.segments[0].bits == 8
        x = rng.standard_normal((5, 64)).astype(np.float32)
        _check(qm.qmatmul(x, m, impl=impl), x, t.dequantize(), impl, 64)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_concatenated_parts(impl):
    rng = np.random.default_rng(7)
    q, k, v = (_tensor(rng, n, 128, 4, 32, "f16") for n in (40, 8, 8))
    m = qm.prepare([q, k, v])
    assert m.shape == (56, 128) and len(m.segments) == 1
    w = np.concatenate([p.dequantize() for p in (q, k, v)])
    x = rng.standard_normal((16, 128)).astype(np.float32)
    _check(qm.qmatmul(x, m, impl=impl), x, w, impl, 32)
    # mixed storage: one segment per run of one format, float parts through BLAS
    dense = rng.standard_normal((9, 128)).astype(np.float32)
    parts = [q, _tensor(rng, 20, 128, 8, 64, "bf16"), dense, v]
    m = qm.prepare(parts)
    assert [s.bits for s in m.segments] == [4, 8, 0, 4]
    w = np.concatenate([p if isinstance(p, np.ndarray) else p.dequantize() for p in parts])
    for rows in (1, 300):
        x = rng.standard_normal((rows, 128)).astype(np.float32)
        _check(qm.qmatmul(x, m, impl=impl), x, w, impl, 32)


@pytest.mark.skipif(qm._ext is None, reason="the C extension is not built")
def test_the_c_repacking_gives_numpys_panels(monkeypatch):
    """prepare reorders 4- and 8-bit words into panels in C where the extension is built: the same words as the
    NumPy repacking, parts of any row count placed one after another and the last panel padded with zeros."""
    rng = np.random.default_rng(8)
    for bits in (4, 8):
        parts = [_tensor(rng, n, 96, bits, 32, "f16") for n in (19, 16, 5)]
        fast = qm.prepare(parts).segments[0].packed
        with monkeypatch.context() as m:
            m.setattr(qm, "_ext", None)
            slow = qm.prepare(parts).segments[0].packed
        assert fast.shape == slow.shape == (3, 96 * bits // 32, 16)
        np.testing.assert_array_equal(fast, slow)
        assert fast[-1, :, :8].any() and not fast[-1, :, 8:].any()  # rows 32..39, then padding
    with pytest.raises(ValueError, match="panel_words"):
        qm._ext.panel_words(np.zeros((17, 4), np.uint32), np.zeros((1, 4, 16), np.uint32), 4, 0)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0])
def test_gguf_blocks_repack_straight_into_panels(qtype):
    """A Q4_0 or Q8_0 matrix kept as the file's blocks gives the panels of its affine form (without biases: they are
    -center * scale) and gguf's own values, rows reordered as the loader reorders q and k."""
    if qm._ext is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(values, qtype).reshape(40, -1)
    parts = [SymmetricBlocks(blocks[:19], qtype, 96), SymmetricBlocks(blocks[19:], qtype, 96).take_rows(
        np.arange(20, -1, -1))]
    direct, affine = qm.prepare(parts), qm.prepare([p.to_affine() for p in parts])
    a, b = direct.segments[0], affine.segments[0]
    np.testing.assert_array_equal(a.packed, b.packed)
    np.testing.assert_array_equal(a.scales.astype(np.float32), b.scales.astype(np.float32))
    assert a.biases is None and b.biases is None and a.center == b.center == (8 if qtype.name == "Q4_0" else 128)
    want = gguf.quants.dequantize(blocks, qtype).reshape(40, 96)
    want = np.concatenate([want[:19], want[19:][::-1]])
    np.testing.assert_array_equal(qm.qembed(direct, np.arange(40)), want)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_array_equal(qm.qmatmul(x, direct), qm.qmatmul(x, affine))


@pytest.mark.parametrize("path", ["c", "numba"])
def test_qembed(path, monkeypatch):
    """Rows looked up by the C extension and by NumPy (where the extension is absent): the dequantized rows' bits."""
    if path == "c" and qm._ext is None:
        pytest.skip("the C extension is not built")
    monkeypatch.setattr(qm, "_IMPL", path)
    rng = np.random.default_rng(3)
    for bits, scales in ((4, "f16"), (8, "f32"), (4, "bf16")):
        t = _tensor(rng, 50, 64, bits, 32, scales)
        ids = np.array([0, 49, 17, 17, 33])
        want = t.dequantize()[ids]
        np.testing.assert_array_equal(qm.qembed(qm.prepare([t]), ids), want)
        np.testing.assert_array_equal(qm.qembed(t, ids), want)
    dense = rng.standard_normal((4, 64)).astype(np.float32)
    m = qm.prepare([t, dense])
    np.testing.assert_array_equal(qm.qembed(m, [52, 3, 50]), np.concatenate([t.dequantize(), dense])[[52, 3, 50]])


def test_storage_stays_quantized():
    rng = np.random.default_rng(1)
    t = _tensor(rng, 960, 576, 4, 32, "f16")
    m = qm.prepare([t])
    stored = t.weight.nbytes + t.scales.nbytes + t.biases.nbytes
    assert m.nbytes == stored  # 960 is a whole number of panels: no padding
    assert m.shape == (960, 576)


@pytest.mark.parametrize("qtype, center", [("Q4_0", 8), ("Q5_0", 16), ("Q8_0", 128)])
def test_symmetric_groups_keep_no_biases(qtype, center):
    """GGUF Q4_0 / Q5_0 / Q8_0 (bias = -center * scale) hold no biases, and every path forms them
    from the scales to the same bits as the stored biases give."""
    rng = np.random.default_rng(center)
    qtype = gguf.GGMLQuantizationType[qtype]
    w = rng.standard_normal((70, 256)).astype(np.float32) * 0.05
    t = _AFFINE_MAPPERS[qtype](gguf.quants.quantize(w, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]), w.shape)
    m = qm.prepare([t])
    (s,) = m.segments
    assert s.biases is None and s.center == center
    assert m.nbytes == s.packed.nbytes + s.scales.nbytes
    ids = np.array([0, 69, 17, 33])
    np.testing.assert_array_equal(qm.qembed(m, ids), t.dequantize()[ids])
    x = rng.standard_normal((5, 256)).astype(np.float32)
    _check(qm.qmatmul(x, m, impl="numba"), x, t.dequantize(), "numba", 32)
    if qm._ext is None:
        return
    before = qm.get_activations()
    try:
        for isa in ISAS:
            qm._ext.set_isa(isa)
            for mode in ("int8", "int16"):
                qm.set_activations(mode)
                for rows in (1, 5, 70):
                    xr = rng.standard_normal((rows, 256)).astype(np.float32)
                    stored = np.empty((rows, 70), np.float32)
                    head, tail = s.c_args()
                    qm._ext.gemm(xr, head[0], head[1], s.bias_array(), stored, *tail)
                    np.testing.assert_array_equal(qm.qmatmul(xr, m), stored, err_msg=f"{isa} {mode} {rows} rows")
    finally:
        qm.set_activations(before)
        qm._ext.set_isa(None)
    # the kernels take -center * sum(x) for the bias term, exact only for a power of two
    head, tail = s.c_args()
    with pytest.raises(ValueError, match="bad shapes, strides or parameters"):
        qm._ext.gemm(xr, head[0], head[1], float(center - 1), stored, *tail)


@pytest.mark.skipif(qm._ext is None, reason="C extension not built")
def test_threads_and_out_argument(every_core):
    rng = np.random.default_rng(2)
    t = _tensor(rng, 300, 256, 4, 64, "f16")
    m = qm.prepare([t])
    x = rng.standard_normal((20, 256)).astype(np.float32)
    n = qm.set_num_threads()
    try:
        many = qm.qmatmul(x, m)
        assert qm.set_num_threads(1) == 1
        out = np.full((20, 300), np.nan, np.float32)
        assert qm.qmatmul(x, m, out) is out
        np.testing.assert_array_equal(out, many)  # each output is summed by one thread, in one order
    finally:
        qm.set_num_threads(n)


def test_environment_forces_numba():
    env = {**os.environ, "EDGESERVE_QMATMUL": "numba"}
    code = "from edgeserve.backends import qmatmul; print(qmatmul.kernel_name())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "numba"


@pytest.mark.parametrize("repack", ["c", "numpy"])
def test_panels_start_on_a_cache_line(repack, monkeypatch):
    """Every array prepare packs starts 64-byte aligned, as the panel cache's do, whichever code repacks it: NumPy's
    own large arrays start 16 bytes into a page, where each vector a kernel loads spans two cache lines. Sizes
    past NumPy's small-block allocator (a few MB), where that offset shows."""
    from tests.test_kquants import random_kquant

    if repack == "c" and qm._ext is None:
        pytest.skip("the C extension is not built")
    if repack == "numpy":
        monkeypatch.setattr(qm, "_ext", None)
    rng = np.random.default_rng(5)
    affine = _tensor(rng, 1024, 2048, 4, 32, "f32")
    blocks = gguf.quants.quantize(rng.standard_normal((1024, 2048)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    weights = [affine, SymmetricBlocks(blocks.reshape(1024, -1), gguf.GGMLQuantizationType.Q4_0, 2048),
               random_kquant(rng, gguf.GGMLQuantizationType.Q6_K, 1024, 2048)]
    for w in weights:
        s = qm.prepare([w]).segments[0]
        arrays = [a for a in (s.packed, s.scales, s.biases, s.hi, s.ksc, s.km) if a is not None]
        assert max(a.nbytes for a in arrays) >= 1 << 20
        assert [a.ctypes.data % 64 for a in arrays] == [0] * len(arrays)
