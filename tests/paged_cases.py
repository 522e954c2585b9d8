"""Random ragged paged-attention batches shared by the kernel tests and the Metal emulation tests."""

from __future__ import annotations

import numpy as np

from edgeserve.batch import Batch, random_paged_batch

# Max abs difference allowed against a float32 reference on the same inputs: the kernels
# accumulate in float32, so what is left is the rounding of the output to its dtype.
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def random_case(seed: int, block_size: int, n_kv: int, group: int, head_dim: int, max_context: int = 2000,
                long_chunk: tuple[int, int] = (700, 300)):
    """A ragged batch over a shuffled random pool: decode rows and prefill chunks, contexts 1..max_context,
    and one long chunk (context, rows) in mid-context."""
    rng = np.random.default_rng(seed)
    contexts = [1, max_context, *rng.integers(2, max_context, size=4).tolist()]
    query_lens = [1 if i % 3 else min(c, int(rng.integers(2, 48))) for i, c in enumerate(contexts)]
    contexts.append(long_chunk[0])  # several query tiles in the NumPy backend
    query_lens.append(long_chunk[1])
    batch, num_blocks = random_paged_batch(contexts, query_lens, block_size, rng, spare_blocks=3)
    q = rng.standard_normal((len(batch.positions), n_kv * group, head_dim)).astype(np.float32) * 3.0  # peaked softmax
    k = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, n_kv, head_dim)).astype(np.float32)
    return batch, q, k, v


def decode_only(batch: Batch, q: np.ndarray) -> tuple[Batch, np.ndarray]:
    """The batch's decode rows alone (one query token per sequence), with their rows of q."""
    rows = np.flatnonzero(batch.query_lens == 1)
    keep = np.isin(np.repeat(np.arange(batch.num_seqs), batch.query_lens), rows)
    decode = Batch(
        token_ids=batch.token_ids[keep],
        positions=batch.positions[keep],
        slot_mapping=batch.slot_mapping[keep],
        query_start=np.arange(len(rows) + 1),
        context_lens=batch.context_lens[rows],
        block_tables=batch.block_tables[rows],
        logits_indices=batch.logits_indices,
        block_size=batch.block_size,
    )
    return decode, q[keep]
