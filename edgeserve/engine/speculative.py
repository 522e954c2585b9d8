"""Speculative decoding's drafting side: guessing a sequence's next tokens, and backing off where guesses miss.

Prompt lookup (n-gram) drafting needs no second model: the last n tokens of a sequence are looked up in its
prompt and output so far, and the tokens that followed their most recent earlier occurrence are the draft.
A decode step then checks the draft in one pass (see LLMEngine), which costs about what one token does
while decoding is bound by reading the weights.

Modes: "off"; "ngram" drafts whenever a match is found; "auto" drafts the same way but, per sequence,
shortens its drafts when they are rejected and pauses drafting (for longer each time) after misses, so
open-ended text that rarely repeats its input costs little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgeserve.config import SPECULATIVE_MODES
from edgeserve.errors import EdgeserveError

if TYPE_CHECKING:
    from edgeserve.engine.sequence import Sequence

MAX_DRAFT = 8  # tokens one draft may hold
NGRAM_MAX = 3  # longest suffix looked up first
NGRAM_MIN = 1
MAX_PAUSE = 64  # most decode steps an "auto" sequence waits after a run of misses


def check_mode(mode: str) -> str:
    if mode not in SPECULATIVE_MODES:
        raise EdgeserveError(f"unknown speculative mode {mode!r} (choose from {', '.join(SPECULATIVE_MODES)})")
    return mode


def lookup_draft(tokens: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens' last n tokens (the longest n
    from n_max down to n_min that occurs); [] where none does."""
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n:]
        # where an occurrence could end, the sequence's own last token excluded: something must follow it
        ends = np.flatnonzero(arr[n - 1 : size - 1] == suffix[-1]) + n - 1
        for end in ends[::-1]:
            if np.array_equal(arr[end - n + 1 : end + 1], suffix):
                return arr[end + 1 : end + 1 + k].tolist()
    return []


@dataclass
class DraftState:
    """One sequence's drafting record, for the back-off of "auto" and the engine's counts."""

    k: int = MAX_DRAFT  # the longest draft it gets next
    pause: int = 0  # decode steps left before it drafts again
    misses: int = 0  # drafts in a row with nothing accepted
    drafted: int = 0
    accepted: int = 0


class Speculator:
    """Which sequences speculate, with which drafts, and what their acceptance teaches the next draft."""

    def __init__(self, mode: str = "off", max_draft: int = MAX_DRAFT):
        self.mode = check_mode(mode)
        self.max_draft = max_draft
        self.drafted = 0  # every sequence's draft tokens so far
        self.accepted = 0
        self.verify_steps = 0  # sequence-steps that checked a draft

    def mode_for(self, seq: Sequence) -> str:
        """The request's own mode where it gave one, else the engine's; constrained requests and those asking
        for logprobs do not speculate (their masks and per-token logprobs are made one token at a time)."""
        p = seq.params
        if p.constraint is not None or p.logprobs is not None:
            return "off"
        return p.speculative or self.mode

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """A draft for seq's next decode step, of at most room tokens (the step's budget and the request's
        remaining length allowing); [] where it should decode one token as usual."""
        mode = self.mode_for(seq)
        if mode == "off":
            return []
        state = seq.draft_state
        if mode == "auto" and state.pause > 0:
            state.pause -= 1
            return []
        k = min(room, self.max_draft, state.k if mode == "auto" else self.max_draft)
        return lookup_draft(seq.token_ids, k)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a checked draft; under "auto", grow the next draft after a full hit, shrink it to what was
        accepted plus one after a partial one, and pause after a miss (twice as long for each miss in a row)."""
        state = seq.draft_state
        state.drafted += drafted
        state.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        if accepted == drafted:
            state.k = min(self.max_draft, state.k * 2)
        else:
            state.k = max(1, accepted + 1)
        if accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.pause = min(MAX_PAUSE, 2 ** (state.misses - 1))
