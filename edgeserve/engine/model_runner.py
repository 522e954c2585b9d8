"""Turning a scheduled step into one batched forward pass and sampled tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from edgeserve.backends.base import Backend
from edgeserve.backends.kv_pool import KVPool
from edgeserve.batch import Batch, SamplingRows
from edgeserve.engine.kv_budget import PoolSize
from edgeserve.engine.scheduler import ScheduledSeq
from edgeserve.engine.step_profile import StepProfile
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
        probe = backend.read_blocks(self.kv.k[0], [0])
        # one block of one layer's K or V: its element type and shape, which the store's bytes are read back as
        self.block_layout: tuple[np.dtype, tuple[int, ...]] = (probe.dtype, probe.shape[1:])

    def build_batch(self, scheduled: list[ScheduledSeq], device_tokens: Any = None) -> Batch:
        """The step's rows; device_tokens: their token ids where those are still on the device."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens, sample_rows, starts = [], [], [0]
        # plain Python per row: a decode step's rows are one token each, where NumPy's per-call cost would
        # be most of the work
        for item in scheduled:
            seq, n, table = item.seq, item.num_new_tokens, item.seq.block_table
            first = item.first_position
            if device_tokens is None:
                tokens += seq.token_ids[first : first + n - len(item.draft)]
                tokens += item.draft
            rows = range(first, first + n)
            positions += rows
            slots += [table[p // bs] * bs + p % bs for p in rows]
            lens.append(first + n)
            starts.append(starts[-1] + n)
            if item.samples:  # a draft's check needs every row's logits: what follows each guess
                sample_rows.extend(range(starts[-1] - 1 - len(item.draft), starts[-1]))
        width = max(len(item.seq.block_table) for item in scheduled)
        block_tables = np.array([item.seq.block_table + [0] * (width - len(item.seq.block_table))
                                 for item in scheduled], dtype=np.int64)
        return Batch(
            token_ids=np.array(tokens, dtype=np.int64) if device_tokens is None else np.zeros(starts[-1], np.int64),
            positions=np.array(positions, dtype=np.int64),
            slot_mapping=np.array(slots, dtype=np.int64),
            query_start=np.asarray(starts, dtype=np.int64),
            context_lens=np.asarray(lens, dtype=np.int64),
            block_tables=block_tables,
            logits_indices=np.asarray(sample_rows, dtype=np.int64),
            block_size=bs,
            device_token_ids=device_tokens,
        )

    def sampled_tokens(self, scheduled: list[ScheduledSeq], rows: SamplingRows | None, device_tokens: Any = None,
                       profile: StepProfile | None = None) -> Any:
        """The step's sampling rows' tokens, drawn on the backend's device (the likeliest where rows is None),
        maybe not yet computed (the backend's `launch` starts them); device_tokens: the step's input tokens,
        where those are still on the device."""
        batch = self.build_batch(scheduled, device_tokens)
        if profile:
            profile.lap("batch")
        tokens = self.backend.sample(self.model.forward(batch, self.kv), rows)
        if profile:
            profile.lap("graph")
        return tokens

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for layer in range(self.args.num_hidden_layers):
            self.kv.k[layer] = self.backend.copy_blocks(self.kv.k[layer], pairs)
            self.kv.v[layer] = self.backend.copy_blocks(self.kv.v[layer], pairs)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        """Each block's K and V of every layer as one byte string, as the pool holds them."""
        parts = []
        for layer in range(self.args.num_hidden_layers):
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                parts.append(self.backend.read_blocks(cache, blocks).reshape(len(blocks), -1).view(np.uint8))
        rows = np.stack(parts, axis=1)  # [blocks, 2 * layers, bytes of one]
        return [row.tobytes() for row in rows]

    def write_blocks(self, blocks: list[int], data: list[bytes]) -> None:
        """Put blocks read by read_blocks (in this pool's layout) back at `blocks`."""
        dtype, shape = self.block_layout
        rows = np.frombuffer(b"".join(data), dtype=np.uint8).reshape(len(blocks), 2 * self.args.num_hidden_layers, -1)
        for layer in range(self.args.num_hidden_layers):
            for i, pool in enumerate((self.kv.k, self.kv.v)):
                values = np.ascontiguousarray(rows[:, 2 * layer + i]).view(dtype).reshape(len(blocks), *shape)
                pool[layer] = self.backend.write_blocks(pool[layer], blocks, values)

    def run(self, scheduled: list[ScheduledSeq], all_rows: bool = False, hidden: bool = False,
            profile: StepProfile | None = None) -> np.ndarray:
        """Forward the step; return float32 logits [sampling rows (or every row), vocab] as NumPy (hidden: the
        final hidden states [rows, hidden_size] instead). A sequence checking a draft has 1 + len(draft)
        sampling rows. profile: the step's, timing its batch, graph and eval phases."""
        batch = self.build_batch(scheduled)
        if all_rows:
            batch.logits_indices = np.arange(len(batch.token_ids))
        if profile:
            profile.lap("batch")
        out = self.model.forward(batch, self.kv, hidden)
        if profile:
            profile.lap("graph")
        logits = self.backend.to_numpy(out)
        if profile:
            profile.lap("eval")
        return logits
