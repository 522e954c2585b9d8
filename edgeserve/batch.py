"""The ragged batch one engine step hands to the model: decode tokens and prefill chunks together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Penalties:
    """Each sampling row's logit bias and repeat penalties, applied on the device as the host's sampler applies
    them (`sampler.apply_penalties`): the bias, then the repetition penalty on the tokens of the row's window,
    then the frequency and presence penalties by each token's count in its output. Token lists are padded with
    -1, which stands for no token."""

    bias_ids: np.ndarray  # [S, B] int32
    bias: np.ndarray  # [S, B] float32
    window_ids: np.ndarray  # [S, W] int32, the distinct tokens the repetition penalty looks at
    repetition: np.ndarray  # [S] float32, 1: off
    output_ids: np.ndarray  # [S, O] int32, the distinct tokens of the output
    output_counts: np.ndarray  # [S, O] float32, how often each
    frequency: np.ndarray  # [S] float32
    presence: np.ndarray  # [S] float32


@dataclass
class SamplingRows:
    """How each sampling row of a step draws its token on the device: temperature 0 takes the likeliest;
    otherwise temperature, then top-k (0: off), min-p and top-p (1: off) as the host's sampler applies them, and
    a draw at `uniform` (a number in [0, 1) from the request's own generator) of the cumulative probabilities;
    bias and penalties first where `penalties` has them, and only the tokens `allowed` holds."""

    temperature: np.ndarray  # [S] float
    top_k: np.ndarray  # [S] int
    top_p: np.ndarray  # [S] float
    min_p: np.ndarray  # [S] float
    uniform: np.ndarray  # [S] float
    penalties: Penalties | None = None
    # [S] each row's latest token where it is still on the device (a step launched ahead): it belongs to the row's
    # repetition window and output, which `penalties` then lists without it
    recent: Any = None
    # [S, ceil(vocab / 8)] uint8: the tokens each row may take (its grammar's mask), one bit each, little-endian
    # within a byte; None: every token
    allowed: np.ndarray | None = None


@dataclass
class Batch:
    """Flat token rows of several sequences, with what paged attention needs to find their K/V.

    Rows of sequence s are token_ids[query_start[s]:query_start[s + 1]]; after this step the
    sequence holds context_lens[s] tokens in the pool, in the blocks listed in block_tables[s].
    """

    token_ids: np.ndarray  # [T] int
    positions: np.ndarray  # [T] int, position of each row in its sequence
    slot_mapping: np.ndarray  # [T] int, pool slot (block * block_size + offset) each row's K/V goes to
    query_start: np.ndarray  # [B + 1] int, cumulative row offsets
    context_lens: np.ndarray  # [B] int
    block_tables: np.ndarray  # [B, max_blocks] int, padded with 0
    logits_indices: np.ndarray  # [S] int, rows whose logits are wanted (usually each sequence's last)
    block_size: int
    # the rows' tokens where they are still on the device (an earlier step's samples), in place of token_ids
    device_token_ids: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start)

    def row_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row as a query of its own: its sequence's block table (cut to the longest context
        any row sees) and the number of keys it sees (its position + 1, causality included)."""
        lens = self.positions + 1
        max_blocks = int(-(-lens.max() // self.block_size)) if len(lens) else 0
        seq_of_row = np.repeat(np.arange(self.num_seqs), self.query_lens)
        return self.block_tables[seq_of_row, :max_blocks], lens

    def decode_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of the single-token (decode) sequences, their block tables cut to the longest context,
        and their context lengths."""
        if len(self.positions) == self.num_seqs:  # every sequence decodes: views, no gathers
            starts, tables, ctx = self.query_start[:-1], self.block_tables, self.context_lens
        else:
            dec = np.flatnonzero(self.query_lens == 1)
            starts, tables, ctx = self.query_start[dec], self.block_tables[dec], self.context_lens[dec]
        max_blocks = int(-(-ctx.max() // self.block_size)) if len(ctx) else 0
        return starts, tables[:, :max_blocks], ctx

    def prefill_chunks(self) -> list[PrefillChunkLayout]:
        """The multi-token (prefill) chunks, each with its causal mask against its whole context."""
        chunks = []
        for s in np.flatnonzero(self.query_lens > 1):
            n, c, start = int(self.query_lens[s]), int(self.context_lens[s]), int(self.query_start[s])
            first = c - n  # position of the chunk's first row
            masked = np.arange(c)[None, :] > (first + np.arange(n))[:, None]
            chunks.append(PrefillChunkLayout(start, n, self.block_tables[s, : -(-c // self.block_size)], c, masked))
        return chunks


@dataclass
class PrefillChunkLayout:
    start: int  # first row in the batch
    length: int
    blocks: np.ndarray  # the sequence's blocks covering context_len
    context_len: int
    masked: np.ndarray  # [length, context_len] bool: True where causality hides a key from a row


def random_paged_batch(contexts: list[int], query_lens: list[int], block_size: int, rng: np.random.Generator,
                       spare_blocks: int = 0) -> tuple[Batch, int]:
    """A ragged batch whose sequences hold shuffled blocks of a pool (for attention tests and benchmarks).

    Returns the batch and the pool's block count (the blocks used plus spare_blocks nobody holds).
    """
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(contexts), max(blocks_per_seq)), dtype=np.int64)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[used : used + n]
        used += n
    positions = np.concatenate([np.arange(c - n, c) for c, n in zip(contexts, query_lens)])
    seq_of_row = np.repeat(np.arange(len(contexts)), query_lens)
    batch = Batch(
        token_ids=np.zeros(len(positions), dtype=np.int64),
        positions=positions,
        slot_mapping=tables[seq_of_row, positions // block_size] * block_size + positions % block_size,
        query_start=np.concatenate([[0], np.cumsum(query_lens)]),
        context_lens=np.asarray(contexts),
        block_tables=tables,
        logits_indices=np.zeros(0, dtype=np.int64),
        block_size=block_size,
    )
    return batch, num_blocks
