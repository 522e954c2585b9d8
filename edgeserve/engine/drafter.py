"""Draft-model drafting for speculative decoding: a second, smaller model with the target's vocabulary guesses
the next tokens of every sequence drafting in a step, all of them in one batch.

The draft model has its own small paged KV pool and block manager. Each sequence it drafts for has a shadow
there: a Sequence of the same request whose tokens follow the target's and whose computed tokens are those the
draft's K/V holds. A draft of k guesses is k forward passes of the draft model over all drafting sequences at
once: the first catches each shadow up on the tokens it has not seen (its prompt, the tokens accepted since its
last draft, the target's last sampled token), each later one feeds back the guess before. Once the target has
checked the draft, the shadow drops the K/V of the guesses it rejected (and the blocks that held only them); its
blocks go back when the sequence finishes, is aborted or is preempted.
"""

from __future__ import annotations

import time

import numpy as np

from edgeserve.backends.base import Backend
from edgeserve.engine.block_manager import BlockManager
from edgeserve.engine.kv_budget import size_pool
from edgeserve.engine.model_runner import ModelRunner
from edgeserve.engine.sampler import draw_guess
from edgeserve.engine.scheduler import ScheduledSeq
from edgeserve.engine.sequence import Sequence
from edgeserve.errors import EdgeserveError
from edgeserve.models.loader import LoadedModel
from edgeserve.text.tokenizer import Tokenizer

DRAFT_KV_SHARE = 0.25  # the draft's KV pool, as a share of the target's KV memory: it holds a smaller model's K/V
TIME_MEMORY = 0.8  # weight the average time of a guess keeps at each draft


def check_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Raise EdgeserveError unless the draft's tokenizer spells every id as the target's does."""
    differ = next((i for i in range(min(target.vocab_size, draft.vocab_size))
                   if target.id_to_token(i) != draft.id_to_token(i)), None)
    if differ is None and target.vocab_size == draft.vocab_size:
        return
    detail = (f"token {differ} is {target.id_to_token(differ)!r} to the target, {draft.id_to_token(differ)!r} to it"
              if differ is not None else f"{draft.vocab_size} tokens against the target's {target.vocab_size}")
    raise EdgeserveError(f"the draft model {draft_name} has another vocabulary than the model it drafts for "
                         f"({detail}): a draft model must share the target's tokenizer")


class DraftModel:
    """A draft model, its KV pool, and the shadows of the sequences it drafts for."""

    def __init__(self, model: LoadedModel, backend: Backend, kv_budget_bytes: int, block_size: int, vocab_size: int):
        self.model = model
        self.pool_size = size_pool(model.args, kv_budget_bytes, block_size, backend.kv_dtype)
        self.runner = ModelRunner(model, backend, self.pool_size)
        # no prefix cache: a shadow's K/V lives only as long as its sequence runs
        self.block_manager = BlockManager(self.pool_size.num_blocks, block_size, enable_prefix_caching=False)
        self.context_len = model.args.max_position_embeddings
        self.vocab_size = vocab_size  # the target's logits' width, which the guesses' distributions take
        # the time of a forward pass feeding back one guess a sequence, averaged over recent drafts (the first pass
        # of a draft, which catches up, is left out: a prompt it catches up on says nothing of what a guess costs)
        self.seconds_per_guess: float | None = None
        self.shadows: dict[str, Sequence] = {}  # by request id

    def reserve(self, seq: Sequence, k: int) -> bool:
        """Make room in the draft's pool for a draft of k guesses for seq (its catch-up, and the k - 1 guesses fed
        back); False (and no room taken) where the pool or the draft model's context is short."""
        if seq.num_tokens + k > self.context_len:
            return False
        shadow = self.follow(seq)
        return self.block_manager.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1)

    def follow(self, seq: Sequence) -> Sequence:
        """seq's shadow, its tokens seq's, its K/V kept as far as they agree (a rejected guess's dropped, with
        the blocks that held only them)."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = self.shadows[seq.request_id] = Sequence(seq.request_id, seq.prompt_ids, seq.params)
            # numbers of its own, independent of the target's yet seeded by them (a seed gives the same text): a
            # guess drawn with the numbers that drew or check the target's tokens would not follow the draft's q
            shadow.rng = seq.rng.spawn(1)[0]
        # the shadow's K/V holds seq's tokens up to the last draft, then that draft's guesses fed back, of which
        # seq took as many as were accepted and then one of its own: the K/V agrees up to seq's last token
        computed = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        del shadow.token_ids[computed:]
        shadow.token_ids += seq.token_ids[computed:]
        shadow.num_computed_tokens = computed
        self.block_manager.trim(shadow)
        return shadow

    def release(self, seq: Sequence) -> None:
        """Free seq's shadow's blocks (it finished, was aborted or preempted)."""
        shadow = self.shadows.pop(seq.request_id, None)
        if shadow is not None:
            self.block_manager.free_seq(shadow)

    def fill(self, items: list[ScheduledSeq]) -> None:
        """Guess the drafts of items (each reserved, its draft's places waiting): the i-th guesses of all of them
        in one forward pass of the draft model. A sampled request's guesses are drawn as it samples, from the
        draft's distribution, kept for the check; a greedy one's are the draft's likeliest tokens."""
        shadows = [self.shadows[item.seq.request_id] for item in items]
        rounds = max(len(item.draft) for item in items)
        start = 0.0
        for i in range(rounds):
            if i == 1:
                start = time.perf_counter()
            live = [(item, shadow) for item, shadow in zip(items, shadows) if i < len(item.draft)]
            logits = self.runner.run([ScheduledSeq(shadow, shadow.num_tokens - shadow.num_computed_tokens)
                                      for _, shadow in live])
            for (item, shadow), row in zip(live, self._target_width(logits)):
                shadow.num_computed_tokens = shadow.num_tokens
                token, probs = draw_guess(row, shadow)
                shadow.token_ids.append(token)
                item.draft[i] = token
                if probs is not None:
                    item.draft_probs.append(probs)
                item.model_draft = True
        if rounds > 1:
            per_guess = (time.perf_counter() - start) / (rounds - 1)
            last = self.seconds_per_guess
            self.seconds_per_guess = per_guess if last is None else TIME_MEMORY * last + (1 - TIME_MEMORY) * per_guess

    def _target_width(self, logits: np.ndarray) -> np.ndarray:
        """The draft's logits over the target's rows: a model may pad its vocabulary with rows no token has, and
        the draft must never guess an id the target has no row for."""
        width = logits.shape[1]
        if width >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = np.full((len(logits), self.vocab_size - width), -np.inf, dtype=logits.dtype)
        return np.concatenate([logits, pad], axis=1)
