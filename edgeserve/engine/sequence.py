"""One request's tokens, its place in the KV pool and its progress through the scheduler.

Its text, stop checks and timings are the output side's (engine/output.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from edgeserve.engine.speculative import DraftState, PromptLookup
from edgeserve.sampling_params import SamplingParams, generator_seed


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # one request is one object: comparing fields would cost the scheduler's `in` checks dearly
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)  # of those, loaded from each prefix-store tier
    prefix_diverged_at: int | None = None  # where the prompt left the longest cached prefix (None: it did not)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full, computed blocks
    draft_state: DraftState = field(default_factory=DraftState)  # its speculative drafting record: prompt lookup's
    model_draft_state: DraftState = field(default_factory=DraftState)  # and the draft model's
    lookup: PromptLookup = field(default_factory=PromptLookup)  # its tokens' n-grams, for prompt lookup's drafts

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.rng = np.random.default_rng(generator_seed(self.params.seed))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1
