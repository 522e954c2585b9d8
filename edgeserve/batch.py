"""The ragged batch one engine step hands to the model: decode tokens and prefill chunks together."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start)
