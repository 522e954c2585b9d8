"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Running decodes go first, then prefill chunks under a per-step token budget, so a long prompt never
stalls running streams. New requests are admitted only when blocks are free; when the pool runs
out, the most recently arrived running sequence is preempted (its blocks freed, recomputed later); if it
was already scheduled in this step, it leaves the step and its tokens go back to the budget.

Static batching, kept to measure against, runs fixed batches as a naive padded-batch server does:
a batch is admitted whole, and a sequence that finishes early keeps its place and its compute (a
padding row that recomputes its last token) until the batch's longest sequence ends. Padding rows take
only the budget left over, and are the first to go when the pool runs out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgeserve.engine.block_manager import BlockManager
from edgeserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    padding: bool = False  # a finished sequence held in a static batch: its last token, recomputed
    draft: list[int] = field(default_factory=list)  # guessed next tokens, checked in this step after its last token
    # the draft model's distribution each guess of a sampled request was drawn from (empty: point masses)
    draft_probs: list[np.ndarray] = field(default_factory=list)
    model_draft: bool = False  # the draft model guessed the draft (else prompt lookup)
    # a decode this many steps after the one running now, launched before that one's token reached the host
    ahead: int = 0

    @property
    def first_position(self) -> int:
        return self.seq.num_computed_tokens - self.padding + self.ahead

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a new token is sampled."""
        return (not self.padding
                and self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens)


# (sequence, most tokens, the step's query rows without this draft, the sequences decoding in the step) -> a draft
# of its next tokens to check in its decode step, or []
Proposer = Callable[[Sequence, int, int, int], list[int]]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 static_batching: bool = False, propose: Proposer | None = None,
                 on_free: Callable[[Sequence], None] | None = None):
        self.bm = block_manager
        self.propose = propose
        self.on_free = on_free  # called whenever a sequence's blocks go back (it finished, was aborted or preempted)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static_batching = static_batching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _victim(self) -> Sequence:
        """Whom to evict when the pool runs out: a finished sequence held in a static batch (only its padding
        is lost), else the latest arrival."""
        held = [s for s in self.running if s.is_finished]
        return held[0] if held else max(self.running, key=lambda s: s.arrival_time)

    def _free(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        if self.on_free is not None:
            self.on_free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        if seq.is_finished:  # a static batch's padding row leaves it; requeued it would run again
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        decodes = decodes_left = sum(1 for s in self.running if not s.is_finished and not s.is_prefilling)
        # decodes before prefill chunks, first come first served among each; a static batch's padding rows
        # last, so they never take the budget its unfinished sequences need
        for seq in sorted(self.running, key=lambda s: (s.is_finished, s.is_prefilling)):
            if seq not in self.running or budget == 0:
                continue
            if seq.is_finished:  # held in its static batch
                if seq.num_computed_tokens:
                    out.append(ScheduledSeq(seq, 1, padding=True))
                    budget -= 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not seq.is_prefilling:
                decodes_left -= 1
            if not seq.is_prefilling and (draft := self._draft(seq, budget, decodes_left, decodes)):
                out.append(ScheduledSeq(seq, 1 + len(draft), draft=draft))
                budget -= 1 + len(draft)
                continue
            while not self.bm.allocate_slots(seq, n):
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                # scheduled earlier in this step (a decode that arrived after this prefill): its blocks are
                # gone, so it leaves the step and gives its tokens back
                for i, item in enumerate(out):
                    if item.seq is victim:
                        budget += out.pop(i).num_new_tokens
                        break
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n))
                budget -= n
        if preempted or (self.static_batching and self.running):
            return out
        # a static batch is admitted whole, then its prefills share the budget over the next steps
        while self.waiting and (budget > 0 or self.static_batching) and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            twin = self._twin(seq) if not (seq.block_table or self.static_batching) else None
            if twin is not None and twin.num_computed_tokens < twin.num_prompt_tokens:
                break  # the same prompt is being computed (a request's n answers): share it once it is
            if twin is not None:
                n = min(seq.num_tokens - seq.num_prompt_tokens + 1, budget)
                if not self.bm.share_prompt(twin, seq, n):
                    break
            else:
                hits = self.bm.match_prefix(seq) if not seq.block_table else []
                n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
                if not self.bm.can_admit(seq, hits, n):
                    break
                self.bm.admit(seq, hits)
                self.bm.allocate_slots(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if n:
                out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _twin(self, seq: Sequence) -> Sequence | None:
        """A running sequence with seq's prompt, the furthest on (a prefix cache sees only full blocks, and only once
        computed: the answers of one prompt admitted together would each compute it all)."""
        twins = [s for s in self.running
                 if s.num_prompt_tokens == seq.num_prompt_tokens and s.prompt_ids == seq.prompt_ids]
        return max(twins, key=lambda s: s.num_computed_tokens, default=None)

    def _draft(self, seq: Sequence, budget: int, decodes_left: int, decodes: int) -> list[int]:
        """A draft for decoding seq, its slots allocated; [] where there is none or the pool is short (a guess
        never preempts anyone). budget: the step's tokens left; decodes_left: decodes to schedule after seq."""
        if self.propose is None or self.static_batching:
            return []
        # all of a draft accepted gives one token more: the request's length limit must still hold them; and a
        # draft takes only budget no later decode needs
        room = min(budget - 1 - decodes_left, seq.params.max_tokens - seq.num_output_tokens - 1)
        # the rows the step will run without this draft: those scheduled, seq's, and the decodes after it
        rows = self.max_num_batched_tokens - budget + 1 + decodes_left
        draft = self.propose(seq, room, rows, decodes) if room > 0 else []
        if draft and not self.bm.allocate_slots(seq, 1 + len(draft)):
            return []
        return draft

    def finish(self, seq: Sequence) -> None:
        """Mark seq finished (or aborted) and release its blocks at once (static batches: at batch end)."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.static_batching and seq in self.running:
            if any(not s.is_finished for s in self.running if s is not seq):
                return
            for s in list(self.running):
                self.running.remove(s)
                self._free(s)
            return
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
