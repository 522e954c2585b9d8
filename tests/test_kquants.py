"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as blocks: exact values, kernel parity, resident bytes, a model load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from edgeserve.backends import qmatmul as qm
from edgeserve.quant.kquants import KQuantTensor
from test_qmatmul import IMPLS, ROWS, _check

T = gguf.GGMLQuantizationType
KTYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def random_kquant(rng: np.random.Generator, qtype: T, rows: int, cols: int, scale: float = 0.01) -> KQuantTensor:
    """Random blocks of `qtype` whose float16 fields are finite: d (and dmin) drawn near `scale`."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    # Q4_K/Q5_K: d and dmin lead the block; Q6_K: d ends it. 6-bit scales are at most 63, and
    # GGUF's quantizers keep d * sc near the values' range, so d is drawn about scale / 32.
    fields = slice(0, 4) if qtype != T.Q6_K else slice(type_size - 2, type_size)
    n = 2 if qtype != T.Q6_K else 1
    d = (rng.uniform(0.2, 1.0, (rows, cols // block_size, n)) * scale / 32).astype(np.float16)
    blocks[:, :, fields] = d.view(np.uint8)
    return KQuantTensor(blocks.reshape(rows, -1), qtype, cols)


def gguf_reference(t: KQuantTensor) -> np.ndarray:
    return gguf.quants.dequantize(np.ascontiguousarray(t.blocks), t.qtype).reshape(t.shape)


@pytest.mark.parametrize("qtype", KTYPES)
def test_dequantize_is_gguf_bit_for_bit(qtype):
    t = random_kquant(np.random.default_rng(int(qtype)), qtype, 5, 512)
    ref = gguf_reference(t)
    np.testing.assert_array_equal(t.dequantize(np.float32), ref)
    # the planes the kernels are packed from give the same values
    p = t.planes()
    per_super = 256 // t.group_size
    scale = np.repeat(p.d, per_super, axis=1) * p.sc.astype(np.float32)
    m = p.sc if p.m is None else p.m
    bias = np.repeat(p.dmin, per_super, axis=1) * m.astype(np.float32)
    q = p.q.reshape(5, -1, t.group_size).astype(np.float32)
    np.testing.assert_allclose((scale[:, :, None] * q + bias[:, :, None]).reshape(t.shape), ref, rtol=1e-6, atol=1e-9)
    assert int(p.q.max()) < 2**t.bits


@pytest.mark.parametrize("qtype", KTYPES)
def test_the_c_repacking_of_blocks_gives_numpys_panels(qtype, monkeypatch):
    """prepare repacks K-quant blocks into panels in C where the extension is built: every array the same as the
    NumPy route's, parts of any row count one after another, the last panel padded with zeros."""
    if qm._ext is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(int(qtype) + 100)
    parts = [random_kquant(rng, qtype, n, 512) for n in (19, 16, 5)]
    fast = qm.prepare(parts).segments[0]
    with monkeypatch.context() as m:
        m.setattr(qm, "_ext", None)
        slow = qm.prepare(parts).segments[0]
    for field in ("packed", "hi", "ksc", "km", "scales", "biases"):
        a, b = getattr(fast, field), getattr(slow, field)
        assert (a is None) == (b is None) == (field == "hi" and qtype == T.Q4_K), field
        if a is not None:
            assert a.dtype == b.dtype, field
            np.testing.assert_array_equal(a, b, err_msg=field)
    assert fast.packed[-1, :, :8].any() and not fast.packed[-1, :, 8:].any()
    with pytest.raises(ValueError, match="block_words"):  # rows that are not whole blocks
        qm._ext.block_words(parts[0].blocks[:, :-1].copy(), int(qtype), fast.packed, fast.hi, 0)


@pytest.mark.parametrize("path", ["c", "numba"])
@pytest.mark.parametrize("qtype", KTYPES)
def test_embedding_rows_from_panels_are_exact(qtype, path, monkeypatch):
    """The C extension's row lookup and the NumPy one (where the extension is absent) give gguf's bits."""
    if path == "c" and qm._ext is None:
        pytest.skip("the C extension is not built")
    monkeypatch.setattr(qm, "_IMPL", path)
    t = random_kquant(np.random.default_rng(7), qtype, 37, 512)
    ids = np.array([0, 36, 5, 16, 17, 5])
    np.testing.assert_array_equal(qm.qembed(qm.prepare([t]), ids), gguf_reference(t)[ids])
    np.testing.assert_array_equal(qm.qembed(t, ids), gguf_reference(t)[ids])


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("qtype", KTYPES)
def test_parity(impl, qtype):
    rng = np.random.default_rng(int(qtype) + 100)
    # 37 columns: two full panels of 16 and a ragged one
    t = random_kquant(rng, qtype, 37, 768)
    m = qm.prepare([t])
    w = t.dequantize()
    for rows in ROWS:
        x = rng.standard_normal((rows, 768)).astype(np.float32)
        _check(qm.qmatmul(x, m, impl=impl), x, w, impl, t.group_size)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("n", [1, 15, 17, 200])
def test_odd_shapes_and_mixed_parts(impl, n):
    rng = np.random.default_rng(n)
    # q/k/v-like parts of three types sharing one input: three segments, one call
    parts = [random_kquant(rng, qtype, n, 256) for qtype in KTYPES]
    m = qm.prepare(parts)
    assert len(m.segments) == 3
    w = np.concatenate([p.dequantize() for p in parts])
    for rows in (1, 7, 65):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        _check(qm.qmatmul(x, m, impl=impl), x, w, impl, 16)


def test_resident_bytes_of_a_q4_k_m_mix():
    # A Q4_K_M-like layer set: Q4_K for most matrices, Q6_K for v / down and the head, one Q5_K
    rng = np.random.default_rng(0)
    parts = [random_kquant(rng, T.Q4_K, 64, 1024) for _ in range(5)]
    parts += [random_kquant(rng, T.Q6_K, 64, 1024) for _ in range(2)]
    parts += [random_kquant(rng, T.Q5_K, 64, 1024)]
    resident = sum(qm.prepare([p]).nbytes for p in parts)
    assert resident <= 1.15 * sum(p.nbytes for p in parts)
    for p in parts:  # bits per weight: 4.625 / 6.625 / 5.625 against 4.5 / 6.5625 / 5.5
        assert qm.prepare([p]).nbytes / p.nbytes < 1.03


def write_tiny_kquant_gguf(path, rng: np.random.Generator) -> dict[str, KQuantTensor]:
    """A two-layer llama GGUF in a Q4_K_M-like mix (Q6_K tied embedding and v, Q5_K/Q6_K down),
    over a byte-level vocabulary of printable ASCII; returns its K-quant tensors."""
    hidden, ffn, heads, kv_heads = 256, 512, 4, 2
    tokens = ["<|endoftext|>", "\u010a", "\u0120", *map(chr, range(33, 127)), "\u0120a"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    w.add_token_merges(["\u0120 a"])
    w.add_eos_token_id(0)
    kq: dict[str, KQuantTensor] = {}

    def add(name: str, qtype: T, rows: int, cols: int) -> None:
        # weights of about 0.2 / sqrt(cols) keep activations of a sane size through the layers
        t = random_kquant(rng, qtype, rows, cols, scale=0.2 / np.sqrt(cols))
        w.add_tensor(name, t.blocks, raw_dtype=qtype)
        kq[name] = t

    add("token_embd.weight", T.Q6_K, len(tokens), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head_dim = hidden // heads
    for i, down in enumerate((T.Q5_K, T.Q6_K)):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(p + "attn_q.weight", T.Q4_K, hidden, hidden)
        add(p + "attn_k.weight", T.Q4_K, kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", T.Q6_K, kv_heads * head_dim, hidden)
        add(p + "attn_output.weight", T.Q4_K, hidden, hidden)
        add(p + "ffn_gate.weight", T.Q4_K, ffn, hidden)
        add(p + "ffn_up.weight", T.Q4_K, ffn, hidden)
        add(p + "ffn_down.weight", down, hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kq


def test_a_k_quant_gguf_runs_from_its_blocks(tmp_path):
    from edgeserve.backends.numpy_backend import resident_weight_bytes
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.models.loader import load_model

    path = tmp_path / "tiny-q4_k_m.gguf"
    kq = write_tiny_kquant_gguf(path, np.random.default_rng(3))
    model = load_model(str(path))
    emb = model.weights["model.embed_tokens.weight"]
    assert isinstance(emb, KQuantTensor) and emb.qtype == T.Q6_K
    np.testing.assert_array_equal(emb.dequantize(), gguf_reference(kq["token_embd.weight"]))
    assert "Q4_K" in model.quantization() and "Q6_K" in model.quantization()

    quantized = LLMEngine(model, backend="numpy", weights="quantized", kv_memory="16MiB")
    layer = quantized.runner.model.layers[0]
    assert all(isinstance(m, qm.QMatrix) for m in (layer.attention.qkv, layer.mlp.down))
    assert [s.ksc is not None for s in layer.attention.qkv.segments] == [True, True]  # Q4_K q/k, Q6_K v
    gguf_bytes = sum(t.nbytes for t in kq.values())
    assert resident_weight_bytes(model, "quantized") - 2 * 4 * 256 * 3 <= 1.15 * gguf_bytes  # norms aside

    float32 = LLMEngine(model, backend="numpy", weights="float32", kv_memory="16MiB")
    ids = model.tokenizer.encode("Hello, K-quants!")
    ref, got = float32.prompt_logits(ids), quantized.prompt_logits(ids)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 1
    # the kernels round activations to int16 per group: ~1e-4 of the logits' size
    assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max()


@pytest.mark.parametrize("qtype", KTYPES)
def test_affine_form_for_mlx_is_exact(qtype):
    t = random_kquant(np.random.default_rng(9), qtype, 3, 512)
    affine = t.to_affine()
    if qtype == T.Q6_K:  # groups of 16: MLX has no such size, so the MLX backend takes float32
        assert affine is None
    else:
        assert (affine.bits, affine.group_size) == (t.bits, 32)
        np.testing.assert_array_equal(affine.dequantize(np.float32), gguf_reference(t))


def test_mlx_backend_and_convert_accept_k_quants(tmp_path):
    pytest.importorskip("mlx.core")
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.models.convert import convert
    from edgeserve.models.loader import load_model

    path = tmp_path / "tiny-q4_k_m.gguf"
    write_tiny_kquant_gguf(path, np.random.default_rng(3))
    model = load_model(str(path))
    ids = model.tokenizer.encode("Hello, K-quants!")
    ref = LLMEngine(model, backend="numpy", weights="float32", kv_memory="16MiB").prompt_logits(ids)
    got = LLMEngine(model, backend="mlx", kv_memory="16MiB").prompt_logits(ids)
    assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()
    result = convert(model, tmp_path / "int4", bits=4, progress=False, measure_errors=True)
    assert {p.action for p in result.plans if p.is_matrix} == {"quantize"}
    assert max(result.relative_errors.values()) < 0.2
