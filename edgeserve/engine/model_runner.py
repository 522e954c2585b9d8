"""Turning a scheduled step into one batched forward pass and sampled tokens."""

from __future__ import annotations

import numpy as np

from edgeserve.backends.base import Backend
from edgeserve.backends.kv_pool import KVPool
from edgeserve.batch import Batch
from edgeserve.engine.kv_budget import PoolSize
from edgeserve.engine.scheduler import ScheduledSeq
from edgeserve.models.loader import LoadedModel
from edgeserve.models.registry import build_model


class ModelRunner:
    def __init__(self, model: LoadedModel, backend: Backend, pool_size: PoolSize):
        self.backend = backend
        self.args = model.args
        self.model = build_model(model.args, model.weights, backend)
        self.kv = KVPool(backend, self.args.num_hidden_layers, pool_size.num_blocks, pool_size.block_size,
                         self.args.num_key_value_heads, self.args.head_dim)
        self.block_size = pool_size.block_size

    def build_batch(self, scheduled: list[ScheduledSeq]) -> Batch:
        bs = self.block_size
        tokens, positions, slots, lens, tables, sample_rows = [], [], [], [], [], []
        starts = [0]
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            first = item.first_position
            pos = np.arange(first, first + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tokens.append(seq.token_ids[first : first + n - len(item.draft)] + item.draft)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            lens.append(first + n)
            tables.append(table)
            starts.append(starts[-1] + n)
            if item.samples:  # a draft's check needs every row's logits: what follows each guess
                sample_rows.extend(range(starts[-1] - 1 - len(item.draft), starts[-1]))
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        return Batch(
            token_ids=np.fromiter((t for chunk in tokens for t in chunk), dtype=np.int64),
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots),
            query_start=np.asarray(starts, dtype=np.int64),
            context_lens=np.asarray(lens, dtype=np.int64),
            block_tables=block_tables,
            logits_indices=np.asarray(sample_rows, dtype=np.int64),
            block_size=bs,
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for layer in range(self.args.num_hidden_layers):
            self.kv.k[layer] = self.backend.copy_blocks(self.kv.k[layer], pairs)
            self.kv.v[layer] = self.backend.copy_blocks(self.kv.v[layer], pairs)

    def run(self, scheduled: list[ScheduledSeq], all_rows: bool = False, hidden: bool = False) -> np.ndarray:
        """Forward the step; return float32 logits [sampling rows (or every row), vocab] as NumPy (hidden: the
        final hidden states [rows, hidden_size] instead). A sequence checking a draft has 1 + len(draft)
        sampling rows."""
        batch = self.build_batch(scheduled)
        if all_rows:
            batch.logits_indices = np.arange(len(batch.token_ids))
        return self.backend.to_numpy(self.model.forward(batch, self.kv, hidden))
