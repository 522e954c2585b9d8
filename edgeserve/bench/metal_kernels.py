"""Benchmark of the paged-attention paths on this machine's MLX device.

    python -m edgeserve.bench.metal_kernels [--model NAME] [--json FILE]

Prints (1) one attention op, kernel against the plain-MLX reference, for decode batches of
1/8/32 sequences at contexts 512/2048 and for a 512-row prefill chunk, (2) MLX's scatter into
the pool (the KV write) at growing pool sizes, and (3) engine decode tokens/s with each path.
The engine runs the given model, or by default SmolLM2-135M's shapes with random 4-bit
weights (the speed of a forward pass does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from edgeserve.batch import random_paged_batch
from edgeserve.metal.dispatch import ENV_VAR, kernel_platform
from edgeserve.metal.kernels import kernel_paged_attention, prepare_kernel
from edgeserve.metal.reference import prepare_reference, reference_paged_attention

# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64, 30 layers.
N_HEADS, N_KV, HEAD_DIM, LAYERS = 9, 3, 64, 30
BLOCK_SIZE = 16


def _time_layers(op: Callable[[int], mx.array], repeats: int = 5) -> float:
    """Milliseconds per call, from LAYERS calls evaluated together (as in one engine step)."""
    mx.eval([op(i) for i in range(LAYERS)])  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([op(i) for i in range(LAYERS)])
        best = min(best, time.perf_counter() - start)
    return 1e3 * best / LAYERS


def bench_attention(platform: str, dtype: Any) -> list[dict]:
    rng = np.random.default_rng(0)
    cases = [("decode", b, c, [c] * b, [1] * b) for c in (512, 2048) for b in (1, 8, 32)]
    cases += [("prefill", 1, c, [c], [512]) for c in (512, 2048)]
    rows = []
    for kind, seqs, context, contexts, query_lens in cases:
        batch, num_blocks = random_paged_batch(contexts, query_lens, BLOCK_SIZE, rng)
        pools = [
            (mx.random.normal((num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM)).astype(dtype),
             mx.random.normal((num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM)).astype(dtype))
            for _ in range(2)
        ]
        q = mx.random.normal((len(batch.token_ids), N_HEADS, HEAD_DIM)).astype(dtype)
        mx.eval(q, pools)
        km, rm = prepare_kernel(batch), prepare_reference(batch)
        kernel_ms = _time_layers(lambda i: kernel_paged_attention(q, *pools[i % 2], km, platform))
        reference_ms = _time_layers(lambda i: reference_paged_attention(q, *pools[i % 2], rm))
        rows.append(dict(kind=kind, seqs=seqs, context=context, query_rows=len(batch.token_ids),
                         kernel_ms=kernel_ms, reference_ms=reference_ms, speedup=reference_ms / kernel_ms))
    return rows


def bench_kv_write(dtype: Any) -> list[dict]:
    """Scatter of 32 rows into pools of growing size: flat times mean MLX updates the pool in place."""
    rows = []
    for num_blocks in (1024, 16384, 65536):
        pool = mx.zeros((num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM), dtype=dtype)
        values = mx.random.normal((32, N_KV, HEAD_DIM)).astype(dtype)
        blocks = mx.array(np.random.default_rng(1).integers(0, num_blocks, 32).astype(np.int32))
        offsets = mx.zeros((32,), dtype=mx.int32)
        mx.eval(pool, values)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            pool[blocks, offsets] = values
            mx.eval(pool)
            times.append(time.perf_counter() - start)
        pool_mib = pool.nbytes / 2**20
        rows.append(dict(pool_blocks=num_blocks, pool_mib=pool_mib, write_ms=1e3 * min(times[2:])))
        del pool
    return rows


def random_model() -> Any:
    """SmolLM2-135M's shapes with random 4-bit (8-bit embedding) weights and a placeholder vocabulary."""
    import tokenizers

    from edgeserve.models.base import ModelArgs
    from edgeserve.models.loader import LoadedModel
    from edgeserve.quant.affine import QuantizedTensor
    from edgeserve.text.tokenizer import Tokenizer

    args = ModelArgs(hidden_size=576, num_hidden_layers=LAYERS, intermediate_size=1536, num_attention_heads=N_HEADS,
                     num_key_value_heads=N_KV, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                     tie_word_embeddings=True)
    rng = np.random.default_rng(0)

    def q(rows: int, cols: int, bits: int = 4) -> QuantizedTensor:
        top = (1 << bits) - 1
        scales = np.full((rows, cols // 32), 0.04 / top, dtype=np.float16)
        words = rng.integers(0, 2**32, (rows, cols * bits // 32), dtype=np.uint32)
        return QuantizedTensor(words, scales, (-scales.astype(np.float32) * top / 2).astype(np.float16), bits, 32)

    h, f = args.hidden_size, args.intermediate_size
    kv = N_KV * HEAD_DIM
    weights: dict[str, Any] = {"model.embed_tokens.weight": q(args.vocab_size, h, 8),
                               "model.norm.weight": np.ones(h, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": q(h, h), p + "self_attn.k_proj.weight": q(kv, h),
            p + "self_attn.v_proj.weight": q(kv, h), p + "self_attn.o_proj.weight": q(h, h),
            p + "mlp.gate_proj.weight": q(f, h), p + "mlp.up_proj.weight": q(f, h), p + "mlp.down_proj.weight": q(h, f),
        })
    with tempfile.TemporaryDirectory() as tmp:
        vocab = {f"t{i}": i for i in range(args.vocab_size)}
        tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")).save(str(Path(tmp) / "tokenizer.json"))
        tokenizer = Tokenizer.from_dir(tmp)
    return LoadedModel(args, weights, tokenizer, Path("random-smollm2-135m-shapes"), "random")


def bench_engine(model: Any, path: str) -> list[dict]:
    """Decode tokens/s through LLMEngine on the MLX backend with one attention path."""
    from edgeserve.engine.llm_engine import LLMEngine
    from edgeserve.sampling_params import SamplingParams

    os.environ[ENV_VAR] = path
    engine = LLMEngine(model, backend="mlx", kv_memory="4GiB", max_num_seqs=64, max_num_batched_tokens=4096)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    new_tokens = 64
    rows = []
    for context in (512, 2048):
        for streams in (1, 8, 32):
            warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            engine.add_request(rng.integers(0, vocab, 16).tolist(), warm)
            while engine.has_unfinished():
                engine.step()
            # The streams share all but the last 16 prompt tokens, so the prefix cache computes
            # the long prefix once; each stream still decodes through its own block table.
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            prefix = rng.integers(0, vocab, context - new_tokens - 16).tolist()
            for _ in range(streams):
                engine.add_request(prefix + rng.integers(0, vocab, 16).tolist(), params)
            decode_steps: list[tuple[float, int]] = []
            while engine.has_unfinished():
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                stats = engine.stats()
                if stats.last_batch_tokens == stats.last_batch_seqs:  # a step of decodes only
                    decode_steps.append((elapsed, len(outputs)))
            # the first decode steps may compile kernels for this shape: leave them out
            decode_time = sum(t for t, _ in decode_steps[2:])
            decode_tokens = sum(n for _, n in decode_steps[2:])
            row = dict(path=engine.backend.attention.name, context=context, streams=streams,
                       decode_tokens_per_s=decode_tokens / decode_time)
            print(f"  {row['path']:13} context {context:4} streams {streams:2}: {row['decode_tokens_per_s']:.1f}")
            rows.append(row)
    del os.environ[ENV_VAR]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model name or path for the engine figures (default: random weights)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    platform = kernel_platform()
    device = str(mx.default_device())
    print(f"device: {device}, kernel platform: {platform or 'none'}")
    result: dict[str, Any] = dict(device=device, platform=platform)
    if platform is None:
        print("no Metal or CUDA GPU for MLX here: only the reference path exists, nothing to compare")
    else:
        result["attention"] = bench_attention(platform, mx.float16)
        print("\nattention op, float16, SmolLM2-135M heads (9 q / 3 kv x 64), block 16, ms per call:")
        for r in result["attention"]:
            print(f"  {r['kind']:7} seqs {r['seqs']:2} context {r['context']:4} rows {r['query_rows']:3}: "
                  f"kernel {r['kernel_ms']:.4f}  reference {r['reference_ms']:.4f}  x{r['speedup']:.2f}")
    result["kv_write"] = bench_kv_write(mx.float16 if platform else mx.float32)
    print("\nKV write (MLX scatter of 32 rows), ms:")
    for r in result["kv_write"]:
        print(f"  pool {r['pool_blocks']:6} blocks ({r['pool_mib']:.0f} MiB): {r['write_ms']:.4f}")
    if args.model:
        from edgeserve.models.loader import load_model

        model, label = load_model(args.model), args.model
    else:
        model, label = random_model(), "random weights, SmolLM2-135M shapes"
    result["engine_model"] = label
    paths = ["reference"] + (["auto"] if platform else [])
    print(f"\nengine decode tokens/s ({label}), 64 new tokens per stream:")
    result["engine"] = [row for p in paths for row in bench_engine(model, p)]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
