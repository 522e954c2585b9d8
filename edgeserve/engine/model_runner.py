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
    """The model and its KV pool in this process: every layer, or those of `layers` (a pipeline stage)."""

    def __init__(self, model: LoadedModel, backend: Backend, pool_size: PoolSize, layers: range | None = None):
        self.backend = backend
        self.args = model.args
        self.layers = range(self.args.num_hidden_layers) if layers is None else layers
        self.model = build_model(model.args, model.weights, backend, layers)
        self.kv = KVPool(backend, len(self.layers), pool_size.num_blocks, pool_size.block_size,
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
        tokens = self.model.greedy_decode(batch, self.kv) if rows is None else None
        if tokens is None:
            tokens = self.backend.sample(self.model.forward(batch, self.kv), rows)
        if profile:
            profile.lap("graph")
        return tokens

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for layer in range(len(self.layers)):
            self.kv.k[layer] = self.backend.copy_blocks(self.kv.k[layer], pairs)
            self.kv.v[layer] = self.backend.copy_blocks(self.kv.v[layer], pairs)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        """Each block's K and V of every layer as one byte string, as the pool holds them."""
        return [row.tobytes() for row in self.read_block_bytes(blocks)]

    def write_blocks(self, blocks: list[int], data: list[bytes]) -> None:
        """Put blocks read by read_blocks (in this pool's layout) back at `blocks`."""
        rows = np.frombuffer(b"".join(data), dtype=np.uint8)
        self.write_block_bytes(blocks, rows.reshape(len(blocks), *self.stored_block_shape))

    @property
    def stored_block_shape(self) -> tuple[int, ...]:
        """One block's K and V as read_block_bytes gives them: [2 x layers (K then V of each), block_size,
        KV heads, bytes of a head]."""
        dtype, shape = self.block_layout
        return (2 * len(self.layers), *shape[:-1], shape[-1] * dtype.itemsize)

    def read_block_bytes(self, blocks: list[int]) -> np.ndarray:
        """The blocks' K and V as uint8 [blocks, *stored_block_shape]."""
        parts = []
        for layer in range(len(self.layers)):
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                parts.append(self.backend.read_blocks(cache, blocks).view(np.uint8))
        return np.stack(parts, axis=1)

    def write_block_bytes(self, blocks: list[int], rows: np.ndarray) -> None:
        """Put blocks read by read_block_bytes back at `blocks`."""
        dtype, shape = self.block_layout
        for layer in range(len(self.layers)):
            for i, pool in enumerate((self.kv.k, self.kv.v)):
                values = np.ascontiguousarray(rows[:, 2 * layer + i]).view(dtype).reshape(len(blocks), *shape)
                pool[layer] = self.backend.write_blocks(pool[layer], blocks, values)

    def close(self) -> None:
        """Let go of what runs beyond this process (nothing: see edgeserve.distributed for a runner that has some)."""

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
