"""The NumPy backend: matmuls from the quantized storage (or float32 BLAS), paged attention over the pool.

Weights stay in their quantized storage (`weights="quantized"`, the default wherever the compiled
kernels of `qmatmul` are built): every matmul, the output head and the embedding lookup compute
from the 4/8-bit groups, so a decode step reads the model file's bytes, not float32 copies 6x their
size. `weights="float32"` holds float32 copies for OpenBLAS GEMMs: the exact oracle for tests, and
the faster choice where only the (slow) numba fallback of the kernels is available. Float32
matrices are stored transposed, [in, out]: OpenBLAS runs `x @ W` with few rows (decode) faster
than `x @ W.T`.

Every row attends through the compiled kernel of `cpu_kernels` as a query of its own (a prefill
row sees keys up to its position), so a row's result never depends on the rows beside it: with
the row-exact matmul kernels, a prompt's logits are the same bits alone, in a batch, or after a
prefix-cache hit, and seeded answers do not change with the server's load. RMSNorm,
RoPE and the SiLU and GELU gates run as single-pass C ops of `cpu_kernels` where the extension is built
(a decode step calls each of them per layer on one row, where NumPy's per-call cost dominates),
as NumPy code otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from edgeserve.backends import WEIGHT_MODES, cpu_kernels, kv_formats, panel_cache, qmatmul
from edgeserve.backends.cpu_decoder import CPUDecoder
from edgeserve.backends.cpu_kernels import compile_now, decode_attention
from edgeserve.backends.qmatmul import QMatrix
from edgeserve.batch import Batch, SamplingRows
from edgeserve.errors import EdgeserveError
from edgeserve.quant.affine import QuantizedTensor
from edgeserve.quant.kquants import KQuantTensor

QUANTIZED = (QuantizedTensor, KQuantTensor)  # weights the kernels compute from as stored

# OpenBLAS's threads spin for a while after each call: beside the kernels' own thread pool on the
# same cores, a 512-token prefill ran 5x slower. Each backend sets the BLAS threads it wants per step.
_BLAS = ThreadpoolController().select(user_api="blas")
_blas_threads: int | None = None


def as_float32(w: Any) -> np.ndarray:
    """A weight as a float32 array, dequantizing where it is stored quantized."""
    if isinstance(w, QUANTIZED):
        return w.dequantize(np.float32)
    return np.ascontiguousarray(w, dtype=np.float32)


def _materialized(w: Any) -> Any:
    """What repacks a deferred weight (its value, or the file's blocks), not kept by it; others as they are."""
    return w.for_repacking() if hasattr(w, "for_repacking") else w


def resident_weight_bytes(model: Any, mode: str) -> int:
    """Bytes of weights a NumpyBackend in `mode` holds for a LoadedModel.

    "quantized" mode holds the quantized storage repacked for the kernels (a tied embedding once,
    shared by the lookup and the output head); "float32" mode holds float32 copies (a tied
    embedding twice: rows to look up, and transposed for the output head).
    """
    _check_mode(mode)
    total = 0
    for w in model.weights.values():
        if mode == "quantized" and isinstance(w, QUANTIZED):
            total += qmatmul.quantized_nbytes(_materialized(w))  # a GGUF file's blocks, never converted to count them
        else:
            total += 4 * int(np.prod(w.shape))
    if mode == "float32" and "lm_head.weight" not in model.weights:
        total += 4 * int(np.prod(model.weights["model.embed_tokens.weight"].shape))
    return total


def choose_weights_mode(model: Any, available_bytes: int) -> str:
    """'quantized' for a quantized model where the compiled kernels run; otherwise 'float32' when
    its copies take at most half of `available_bytes` (BLAS beats the numba fallback), else 'quantized'."""
    quantized = any(isinstance(w, QUANTIZED) for w in model.weights.values())
    if quantized and qmatmul.compiled():
        return "quantized"
    return "float32" if 2 * resident_weight_bytes(model, "float32") <= available_bytes else "quantized"


def _check_mode(mode: str) -> None:
    if mode not in WEIGHT_MODES:
        raise EdgeserveError(f"unknown weights mode {mode!r} (choose from {', '.join(WEIGHT_MODES)})")


@dataclass
class NumpyMeta:
    """Per-step arrays, computed once and shared by every layer."""

    token_ids: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    cos: np.ndarray  # [T, 1, head_dim / 2]
    sin: np.ndarray
    block_tables: np.ndarray  # [T, max_blocks] each row's sequence's blocks
    context_lens: np.ndarray  # [T] keys each row sees
    positions: np.ndarray  # [T], for `with_rope`


class NumpyBackend:
    name = "numpy"
    computes_async = False
    launch_early = False
    chains_steps = False

    def __init__(self, weights: str = "float32", threads: int | None = None, activations: str | None = None,
                 kv_dtype: str = "float32"):
        _check_mode(weights)
        self.weights = weights
        self.kv_dtype = kv_dtype
        self.threads = qmatmul.set_num_threads(threads)
        if activations is not None:  # one setting for the process, like the threads
            qmatmul.set_activations(activations)
        # quantized mode calls BLAS only for float matrices a quantized model may keep (rare)
        self.blas_threads = 1 if weights == "quantized" else self.threads
        compile_now()  # at start-up, not inside the first request's timings
        if weights == "quantized":
            qmatmul.compile_now()
        self._panel_caches: dict[str, panel_cache.PanelCache] = {}
        self._model_maps: dict[str, Any] = {}  # each cached model file's memory map, whose pages commit drops

    def describe(self) -> str:
        if self.weights == "quantized":
            threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
            return (f"numpy (quantized weights, {qmatmul.kernel_name()} kernels, {qmatmul.get_activations()} "
                    f"activations, {threads})")
        return "numpy (float32 weights)"

    def vector(self, w: Any) -> np.ndarray:
        # a copy, never a view of the model file's map: its pages are dropped once the panels are in place
        return np.array(as_float32(w), dtype=np.float32)

    def embedding(self, w: Any) -> np.ndarray | QMatrix:
        if self.weights == "quantized" and isinstance(w, QUANTIZED):
            return self._prepare([w])
        return as_float32(w)

    def head(self, table: np.ndarray | QMatrix) -> np.ndarray | QMatrix:
        """The output head from an embedding table: the same QMatrix, or transposed to [hidden, vocab]."""
        return table if isinstance(table, QMatrix) else np.ascontiguousarray(table.T)

    def linear(self, parts: list[Any]) -> np.ndarray | QMatrix:
        """Fuse weights sharing an input (q/k/v, gate/up) into one matrix: one kernel call or GEMM each."""
        if self.weights == "quantized" and any(isinstance(p, QUANTIZED) for p in parts):
            return self._prepare([p if isinstance(p, QUANTIZED) else as_float32(p) for p in parts])
        return np.ascontiguousarray(np.concatenate([as_float32(p) for p in parts], axis=0).T)

    def _prepare(self, parts: list[Any]) -> QMatrix:
        """`qmatmul.prepare`, through the model file's panel cache where every part names its origin
        in one file (a weight deferred by the GGUF loader): a hit maps the panels and never reads
        the parts; a miss repacks them into the cache file (completed by `commit_panels`) and
        drops the model file's pages it read, so the process never holds the weights twice."""
        origins = [getattr(p, "origin", None) for p in parts]
        files = {o.file for o in origins if o is not None}
        if None in origins or len(files) != 1 or not panel_cache.enabled():
            return qmatmul.prepare([_materialized(p) for p in parts])
        file = files.pop()
        cache = self._panel_caches.get(file)
        if cache is None:
            cache = self._panel_caches[file] = panel_cache.PanelCache.for_file(file)
            self._model_maps[file] = parts[0].file_map()
        key = "+".join(o.key for o in origins)
        m = cache.get(key, (sum(p.shape[0] for p in parts), parts[0].shape[1]))
        if m is None:
            m = qmatmul.prepare([_materialized(p) for p in parts])
            cache.add(key, m)
            panel_cache.drop_pages(parts[0].file_map())
        return m

    def commit_panels(self) -> None:
        """Complete the cache files of the matrices repacked since the last call, and drop the pages of the model
        files that loading touched (metadata, norms: with the kernel's large folios, 2 MiB each) from this
        process's memory: the panels hold every matrix, so the files are not read again."""
        for file, cache in self._panel_caches.items():
            cache.commit()
            panel_cache.drop_pages(self._model_maps.get(file))

    def fuse_blocks(self, layers: list[Any], eps: float,
                    ropes: list[tuple[np.ndarray, np.ndarray]]) -> CPUDecoder | None:
        if self.weights != "quantized":
            return None
        self.commit_panels()
        return CPUDecoder.build(layers, eps, ropes, self.kv_dtype)

    def greedy_decoder(self, blocks: Any, embed: Callable[[np.ndarray], np.ndarray],
                       head: Callable[[np.ndarray], np.ndarray]) -> None:
        return None  # a step's host work is small beside its kernels here

    def rope_tables(self, inv_freq: np.ndarray, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def batch_meta(self, batch: Batch, rope: tuple[np.ndarray, np.ndarray]) -> NumpyMeta:
        if any(c.pending for c in self._panel_caches.values()):  # a family without fused blocks
            self.commit_panels()
        _set_blas_threads(self.blas_threads)
        cos, sin = rope
        blocks, lens = batch.row_layout()
        return NumpyMeta(
            token_ids=batch.token_ids,
            slot_mapping=batch.slot_mapping,
            logits_indices=batch.logits_indices,
            cos=cos[batch.positions][:, None, :],
            sin=sin[batch.positions][:, None, :],
            block_tables=blocks,
            context_lens=lens,
            positions=batch.positions,
        )

    def with_rope(self, meta: NumpyMeta, rope: tuple[np.ndarray, np.ndarray]) -> NumpyMeta:
        cos, sin = rope
        return dataclasses.replace(meta, cos=cos[meta.positions][:, None, :], sin=sin[meta.positions][:, None, :])

    def embed(self, table: np.ndarray | QMatrix, ids: np.ndarray) -> np.ndarray:
        if isinstance(table, QMatrix):
            return qmatmul.qembed(table, ids)
        return table[ids]

    def matmul(self, x: np.ndarray, w: np.ndarray | QMatrix) -> np.ndarray:
        if isinstance(w, QMatrix):
            return qmatmul.qmatmul(np.ascontiguousarray(x), w)
        return x @ w

    def lm_head(self, x: np.ndarray, head: np.ndarray | QMatrix) -> np.ndarray:
        return self.matmul(x, head)

    def take_rows(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        if (out := cpu_kernels.rms_norm(x, w, eps)) is not None:
            return out
        ss = np.einsum("ij,ij->i", x, x)  # one pass, no x * x temporary
        ss *= np.float32(1.0 / x.shape[-1])
        ss += np.float32(eps)
        out = x * (1.0 / np.sqrt(ss))[:, None]
        out *= w
        return out

    def apply_rope(self, x: np.ndarray, meta: NumpyMeta) -> np.ndarray:
        if (out := cpu_kernels.apply_rope(x, meta.cos, meta.sin)) is not None:
            return out
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * meta.cos - x2 * meta.sin, x2 * meta.cos + x1 * meta.sin], axis=-1)

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        if (out := cpu_kernels.silu_mul(gate_up)) is not None:
            return out
        half = gate_up.shape[-1] // 2
        g, u = gate_up[:, :half], gate_up[:, half:]
        # one scratch array worked in place: the MLP's largest activation is not copied at each op
        s = np.negative(g)
        np.exp(s, out=s)
        s += 1.0
        np.divide(g, s, out=s)
        s *= u
        return s

    def gelu_tanh_mul(self, gate_up: np.ndarray) -> np.ndarray:
        if (out := cpu_kernels.gelu_tanh_mul(gate_up)) is not None:
            return out
        half = gate_up.shape[-1] // 2
        g, u = gate_up[:, :half], gate_up[:, half:]
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) in one scratch array, worked in place
        s = g * g
        s *= np.float32(0.044715)
        s += np.float32(1.0)
        s *= g
        s *= np.float32(math.sqrt(2.0 / math.pi))
        np.tanh(s, out=s)
        s += np.float32(1.0)
        s *= g
        s *= np.float32(0.5)
        s *= u
        return s

    def soft_cap(self, x: np.ndarray, cap: float) -> np.ndarray:
        out = np.tanh(x / np.float32(cap))
        out *= np.float32(cap)
        return out

    def allocate_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
        return kv_formats.allocate(self.kv_dtype, num_blocks, block_size, n_kv_heads, head_dim)

    def write_kv(self, cache: np.ndarray, values: np.ndarray, meta: NumpyMeta) -> np.ndarray:
        if not cpu_kernels.write_kv(cache, values, meta.slot_mapping):
            cache.reshape(-1, *cache.shape[2:])[meta.slot_mapping] = kv_formats.store(values, self.kv_dtype)
        return cache

    def copy_blocks(self, cache: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
        for src, dst in pairs:
            cache[dst] = cache[src]
        return cache

    def read_blocks(self, cache: np.ndarray, blocks: list[int]) -> np.ndarray:
        return cache[blocks]

    def write_blocks(self, cache: np.ndarray, blocks: list[int], values: np.ndarray) -> np.ndarray:
        cache[blocks] = values
        return cache

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def sample(self, logits: np.ndarray, rows: SamplingRows | None) -> np.ndarray:
        return np.argmax(logits, axis=-1)  # rows is None: the host computes, so the host's sampler draws

    def launch(self, tokens: np.ndarray) -> None:
        return None  # computed already: the NumPy backend computes as the step's graph is built

    def fetch_tokens(self, tokens: np.ndarray) -> list:
        return tokens.tolist()

    def stack_tokens(self, steps: list[np.ndarray]) -> np.ndarray:
        return np.stack(steps)

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: NumpyMeta,
                        window: int | None = None) -> np.ndarray:
        """Attention of each row over its sequence's K/V up to its own position (its last `window` keys
        where given), read through the block tables."""
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, window)


def _set_blas_threads(n: int) -> None:
    """Give BLAS n threads, unless it has them already (a step's first call is then free)."""
    global _blas_threads
    if n != _blas_threads:
        for lib in _BLAS.lib_controllers:
            lib.set_num_threads(n)
        _blas_threads = n
