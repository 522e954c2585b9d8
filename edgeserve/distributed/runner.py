"""A model split across the ranks of a group: rank 0's runner, which the engine drives as it drives a runner of
one process, and the loop every other rank runs, doing each step what rank 0's message says.

Each step rank 0 sends every rank the step's batch (token ids, positions, slot mapping, block tables), the
copy-on-write copies, or the prefix store's block reads and writes; each rank keeps the K/V of its share of the
model in a pool of its own, indexed by the same block tables. Pipeline: rank 0 computes the first stage and hands
the residual stream to rank 1, and so on; the last stage sends back what the step needs (greedy tokens, logits or
final hidden states) to rank 0, its neighbour in the ring. A greedy step of several sequences goes as two
micro-batches, so that rank 0 computes the second's first stage while rank 1 computes the first's second: one
after the other, each stage waited for the one before. Tensor: every rank runs the whole step on its heads and
MLP columns, adding up the partial sums of each layer's o and down projections over the group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from edgeserve.backends.mlx_backend import MLXBackend
from edgeserve.batch import Batch, SamplingRows
from edgeserve.config import EngineConfig
from edgeserve.distributed.group import Group
from edgeserve.distributed.plan import Share, describe_share, kv_args, plan, rank_args, shard_weights
from edgeserve.engine.kv_budget import PoolSize, size_pool
from edgeserve.engine.model_runner import ModelRunner
from edgeserve.engine.scheduler import ScheduledSeq
from edgeserve.engine.step_profile import StepProfile
from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import LoadedModel

BATCH_FIELDS = ("token_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables",
                "logits_indices")
# The fewest rows a step splits at: two halves cost what the whole does only where a row costs about the same at
# either size (on MLX's CPU from about 2 rows on; 2 ranks there: 8 decode rows 1.6-2.1 s a step split, 2.2-2.4 s
# whole, but 4 rows 1.2 s split, 1.0 s whole). Where rows come nearly free (a GPU's small batches), each half would
# read the weights again.
MICRO_BATCH_ROWS = 8


def micro_batches(batch: Batch) -> list[Batch]:
    """The step as two batches of whole sequences with about half its rows each, the first's sampling rows first;
    the step whole where it has one sequence or fewer than MICRO_BATCH_ROWS rows, or where one half reads a block
    the other writes (the first half's pool writes land before the second half runs: the halves must not depend on
    each other)."""
    qs, bs = batch.query_start, batch.block_size
    if batch.num_seqs < 2 or qs[-1] < MICRO_BATCH_ROWS or np.any(np.diff(batch.logits_indices) <= 0):
        return [batch]
    cut = int(np.clip(np.searchsorted(qs, qs[-1] / 2), 1, batch.num_seqs - 1))
    rows = int(qs[cut])
    written = batch.slot_mapping // bs
    read = np.arange(batch.block_tables.shape[1]) < -(-batch.context_lens // bs)[:, None]  # the blocks each reads
    if (np.isin(batch.block_tables[:cut][read[:cut]], written[rows:]).any()
            or np.isin(batch.block_tables[cut:][read[cut:]], written[:rows]).any()):
        return [batch]
    return [_sequences(batch, 0, cut), _sequences(batch, cut, batch.num_seqs)]


def _sequences(batch: Batch, first: int, end: int) -> Batch:
    """Sequences first..end-1 of batch as a batch of their own, their rows and sampling rows counted from 0."""
    r0, r1 = int(batch.query_start[first]), int(batch.query_start[end])
    sampled = batch.logits_indices[(batch.logits_indices >= r0) & (batch.logits_indices < r1)]
    return Batch(batch.token_ids[r0:r1], batch.positions[r0:r1], batch.slot_mapping[r0:r1],
                 batch.query_start[first : end + 1] - r0, batch.context_lens[first:end], batch.block_tables[first:end],
                 sampled - r0, batch.block_size)


def start_group(model: LoadedModel, config: EngineConfig, group: Group) -> tuple[MLXBackend, PoolSize, ModelRunner]:
    """Rank 0's backend, KV pool size (every rank's pool has as many blocks) and runner; the other ranks, in
    `serve_rank`, build theirs from what this sends them. A group of one runs as one process does."""
    if config.backend not in ("auto", "mlx"):
        raise EdgeserveError(f"--distributed runs on the mlx backend (the {config.backend} backend runs on one "
                             "machine)")
    shares = plan(model.args, config.distributed, group.size)
    backend = MLXBackend(config.kv_dtype, group=group.group if config.distributed == "tensor" else None)
    # each rank's pool holds its share of every block: sized so that the largest share fits the budget
    pool_size = min((size_pool(kv_args(model.args, config.distributed, share), config.kv_budget_bytes(),
                               config.block_size, backend.kv_dtype) for share in shares), key=lambda p: p.num_blocks)
    if group.size == 1:
        return backend, pool_size, ModelRunner(model, backend, pool_size)
    # a split model's tokens come back through the group each step: nothing is launched ahead or chained, and rows
    # that sample draw on the host
    backend.computes_async = False
    backend.chains_steps = False
    group.broadcast({"op": "setup", "mode": config.distributed, "num_blocks": pool_size.num_blocks,
                     "block_size": pool_size.block_size, "kv_dtype": backend.kv_dtype})
    return backend, pool_size, GroupRunner(model, backend, pool_size, config.distributed, group)


class GroupRunner(ModelRunner):
    """Rank 0's share of the model; each call first tells every rank what to do."""

    def __init__(self, model: LoadedModel, backend: MLXBackend, pool_size: PoolSize, mode: str, group: Group):
        self.mode, self.group = mode, group
        self.shares = plan(model.args, mode, group.size)
        own, layers = _rank_model(model, mode, self.shares[0])
        super().__init__(own, backend, pool_size, layers)
        self.whole = model.args  # the model's own arguments (self.args: this rank's, in tensor mode)

    def describe(self) -> str:
        """One line for the start-up message: how the model is split."""
        ranks = "; ".join(f"rank {i}: {describe_share(self.whole, share)}" for i, share in enumerate(self.shares))
        return f"split over {self.group.size} ranks ({self.mode}): {ranks}"

    def sampled_tokens(self, scheduled: list[ScheduledSeq], rows: SamplingRows | None, device_tokens: Any = None,
                       profile: StepProfile | None = None) -> Any:
        """The step's greedy tokens, computed (rows that sample draw on the host: see start_group)."""
        if rows is not None or device_tokens is not None:
            raise EdgeserveError("a model split across ranks draws only greedy tokens on the device")
        batch = self.build_batch(scheduled)
        if profile:
            profile.lap("batch")
        return self._forward(batch, "tokens")

    def run(self, scheduled: list[ScheduledSeq], all_rows: bool = False, hidden: bool = False,
            profile: StepProfile | None = None) -> np.ndarray:
        batch = self.build_batch(scheduled)
        if all_rows:
            batch.logits_indices = np.arange(len(batch.token_ids))
        if profile:
            profile.lap("batch")
        out = self.backend.to_numpy(self._forward(batch, "hidden" if hidden else "logits"))
        if profile:
            profile.lap("eval")
        return out

    def _forward(self, batch: Batch, result: str) -> mx.array:
        """Run the step on every rank; `result` ("tokens", "logits" or "hidden") of its sampling rows, computed.
        Only greedy tokens go as micro-batches: what the last stage sends back of the first must fit the link's
        buffers while rank 0 still sends the second (a row's logits would not)."""
        g, be = self.group, self.backend
        parts = micro_batches(batch) if self.mode == "pipeline" and result == "tokens" else [batch]
        g.broadcast({"op": "forward", "result": result, "block_size": batch.block_size, "parts": len(parts),
                     **{f"{i}.{name}": getattr(part, name) for i, part in enumerate(parts) for name in BATCH_FIELDS}})
        with g.guard():
            if self.mode == "tensor":
                out = _result(be, self.model.forward(batch, self.kv, hidden=result == "hidden"), result)
                be.evaluate(out)
                return out
            for part in parts:
                be.evaluate(g.send(self.model.forward(part, self.kv), 1))
            width = {"tokens": (), "logits": (self.whole.vocab_size,), "hidden": (self.whole.hidden_size,)}[result]
            dtype = mx.int32 if result == "tokens" else mx.float32
            outs = []
            for part in parts:
                if len(part.logits_indices):  # a part that samples nothing gets nothing back from the last stage
                    outs.append(g.recv((len(part.logits_indices), *width), dtype, g.size - 1))
                    mx.eval(outs[-1])  # one receive at a time: the link delivers the parts in order
            return mx.concatenate(outs) if outs else mx.zeros((0, *width), dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks on every rank; like write_block_bytes, done before the step that waits for them."""
        self.group.broadcast({"op": "copy", "pairs": pairs})
        super().copy_blocks(pairs)
        self.backend.evaluate()

    @property
    def stored_block_shape(self) -> tuple[int, ...]:
        """As one process stores a block: every layer, every KV head."""
        _, block_size, _, head_bytes = super().stored_block_shape
        return (2 * self.whole.num_hidden_layers, block_size, self.whole.num_key_value_heads, head_bytes)

    def read_block_bytes(self, blocks: list[int]) -> np.ndarray:
        """Every rank's share of the blocks, put together as one process holds them."""
        self.group.broadcast({"op": "read", "blocks": blocks})
        parts = _gather_blocks(self.group, self, self.shares, blocks)
        return np.concatenate(parts, axis=1 if self.mode == "pipeline" else 3)  # layers, or KV heads

    def write_block_bytes(self, blocks: list[int], rows: np.ndarray) -> None:
        self.group.broadcast({"op": "write", "blocks": blocks, "rows": rows})
        super().write_block_bytes(blocks, _own_part(rows, self.mode, self.shares[0]))
        # written now, on every rank: pending pool writes evaluated with the step's sends and receives were seen to
        # stall the ring
        self.backend.evaluate()

    def close(self) -> None:
        """Let the other ranks go."""
        self.group.broadcast({"op": "stop"})


def serve_rank(model: LoadedModel, group: Group) -> None:
    """A rank other than 0: build its share of the model from rank 0's setup, then do what each of rank 0's
    messages says until it says stop (a GroupLostError where rank 0 or another rank goes)."""
    setup = group.broadcast()
    mode = setup["mode"]
    shares = plan(model.args, mode, group.size)
    share = shares[group.rank]
    backend = MLXBackend(setup["kv_dtype"], group=group.group if mode == "tensor" else None)
    pool_size = PoolSize(setup["num_blocks"], setup["block_size"], 0, setup["kv_dtype"])
    own, layers = _rank_model(model, mode, share)
    runner = ModelRunner(own, backend, pool_size, layers)
    last = group.rank == group.size - 1
    while True:
        message = group.broadcast()
        op = message["op"]
        if op == "stop":
            return
        if op == "copy":
            runner.copy_blocks([tuple(pair) for pair in message["pairs"]])
            backend.evaluate()
        elif op == "read":
            _gather_blocks(group, runner, shares, message["blocks"])
        elif op == "write":
            runner.write_block_bytes(message["blocks"], _own_part(message["rows"], mode, share))
            backend.evaluate()
        elif op == "forward":
            result = message["result"]
            with group.guard():
                for i in range(message["parts"]):
                    batch = Batch(**{name: message[f"{i}.{name}"] for name in BATCH_FIELDS},
                                  block_size=message["block_size"])
                    if mode == "tensor":  # rank 0 reads the answer; the others only add their partial sums
                        backend.evaluate(runner.model.forward(batch, runner.kv, hidden=True))
                        continue
                    h = group.recv((len(batch.token_ids), model.args.hidden_size), backend.dtype, group.rank - 1)
                    out = runner.model.forward(batch, runner.kv, hidden=result == "hidden", h=h)
                    if not last:
                        backend.evaluate(group.send(out, group.rank + 1))
                    elif len(batch.logits_indices):
                        backend.evaluate(group.send(_result(backend, out, result), 0))
                    else:
                        backend.evaluate(out)
        else:
            raise EdgeserveError(f"rank 0 sent an unknown message {op!r}")


def _result(backend: MLXBackend, out: mx.array, result: str) -> mx.array:
    """What the step sends back of the last stage's output: greedy tokens, or float32 logits or states."""
    return backend.sample(out, None) if result == "tokens" else out.astype(mx.float32)


def _rank_model(model: LoadedModel, mode: str, share: Share) -> tuple[LoadedModel, range | None]:
    """The model one rank builds, and its layers: a pipeline stage, or every layer with the rank's heads and MLP
    columns (tensor)."""
    if mode == "pipeline":
        return model, share.layers
    return dataclasses.replace(model, args=rank_args(model.args, share),
                               weights=shard_weights(model.args, model.weights, share)), None


def _share_shapes(runner: ModelRunner, shares: list[Share]) -> list[tuple[int, ...]]:
    """One block as each rank stores it: [2 x its layers, block_size, its KV heads, bytes of a head]."""
    dtype, (block_size, _, elements) = runner.block_layout
    return [(2 * len(s.layers), block_size, len(s.kv_heads), elements * dtype.itemsize) for s in shares]


def _gather_blocks(group: Group, runner: ModelRunner, shares: list[Share], blocks: list[int]) -> list[np.ndarray]:
    """Every rank's share of the blocks, each as [blocks, *its stored shape] (every rank calls it)."""
    shapes = [(len(blocks), *shape) for shape in _share_shapes(runner, shares)]
    own = ModelRunner.read_block_bytes(runner, blocks)
    parts = group.gather(own, [int(np.prod(shape)) for shape in shapes])
    return [part.reshape(shape) for part, shape in zip(parts, shapes)]


def _own_part(rows: np.ndarray, mode: str, share: Share) -> np.ndarray:
    """This rank's share of blocks stored as one process stores them."""
    if mode == "pipeline":
        return rows[:, 2 * share.layers.start : 2 * share.layers.stop]
    return rows[:, :, :, share.kv_heads.start : share.kv_heads.stop]
