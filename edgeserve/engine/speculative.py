"""Speculative decoding's drafting side: guessing a sequence's next tokens, and drafting only where it pays.

Prompt lookup (n-gram) drafting needs no second model: the last n tokens of a sequence are looked up in its
prompt and output so far, and the tokens that followed their most recent earlier occurrence are the draft.
A decode step then checks the draft in one pass (see LLMEngine): each guess is one more query row. A draft model
(engine/drafter.py) guesses where no text repeats, at the cost of its own forward passes: the scheduler decides
how long each sequence's draft is, and the draft model makes all of a step's drafts at once once it is scheduled.

What a row costs depends on the machine and the batch: while a step is bound by reading the weights (one
stream on a CPU, most batches on a GPU) extra rows are nearly free; a CPU step of a 1B model is compute-bound
from about two rows on, where each row costs about half a one-row step; float32 weights on BLAS take twice as
long for two rows as for one, and little more for nine. So "auto" measures it: StepCost keeps the median time
of each row count the engine ran, and each draft is as long as maximizes the step's expected tokens per second,
given the sequence's measured acceptance (0 tokens, no draft, where none pays by a margin); with a draft model
too, the drafter whose draft promises more.

Modes: "off"; "ngram" drafts whenever a match is found, as long as it may; "draft" drafts with the draft model
every step, as long as it may; "auto" as above, with the draft model where prompt lookup finds nothing worth
checking, its time per guess counted in the step's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeserve.config import SPECULATIVE_MODES
from edgeserve.errors import EdgeserveError

if TYPE_CHECKING:
    from edgeserve.engine.drafter import DraftModel
    from edgeserve.engine.sequence import Sequence

MAX_DRAFT = 8  # tokens one draft may hold
NGRAM_MAX = 3  # longest suffix looked up first
NGRAM_MIN = 1
COST_WINDOW = 256  # recent steps the step times are read from
MIN_SAMPLES = 3  # steps at a row count before their median is trusted
EXPLORE_DRAFT = 2  # the draft "auto" tries now and then where its estimates advise against one
EXPLORE_EVERY = 64  # steps between tries of a draft the estimates say does not pay, so they can change their mind
HOPELESS_EVERY = 16 * EXPLORE_EVERY  # and where even guesses all right would not pay for the time they take to make
FIRST_CHECKS = 2  # drafts each sequence may try before its acceptance is trusted (of each drafter)
DECAY = 0.9  # weight an acceptance record keeps at each step with a draft to propose (a draft model's: each check)
PRIOR_CHECKS = 2  # checks' worth of weight the pooled acceptance has in each draft position's own
MARGIN = 0.05  # more tokens a second a draft must promise than none: a check's host work (its rows' sampling,
# the rollback) is not in the step time the estimates are made of
PENDING = -1  # a place in a draft the draft model fills once the step is scheduled (Speculator.propose)


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


class StepCost:
    """A step's time by its query rows: the median of the recent steps with as many rows, else read off the line
    through the medians of the nearby row counts above one (one row runs other kernels than several: a
    matrix-vector product, the decode kernels), else, with a single such count, the line from one row to it. A line
    through all counts, one row's included, told a 9-row step's time at twice what it was."""

    def __init__(self, window: int = COST_WINDOW):
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._medians: dict[int, float] | None = None  # by row count, while no step is observed
        self._times: dict[tuple[int, int], list[float] | None] = {}  # times() asked since, by its arguments

    def observe(self, rows: int, seconds: float) -> None:
        self._samples.append((rows, seconds))
        self._medians = None
        self._times = {}

    def medians(self) -> dict[int, float]:
        """The median step time of each row count with enough recent steps to trust it."""
        if self._medians is None:
            by_rows: dict[int, list[float]] = {}
            for n, t in self._samples:
                by_rows.setdefault(n, []).append(t)
            self._medians = {n: float(np.median(ts)) for n, ts in by_rows.items() if len(ts) >= MIN_SAMPLES}
        return self._medians

    def samples(self) -> list[tuple[int, float]]:
        """The recent steps' (rows, seconds), oldest first."""
        return list(self._samples)

    def seed(self, samples: list[tuple[int, float]]) -> None:
        """Start from the steps earlier runs timed (engine/cost_memory.py), as if this run had timed them: its own
        steps outvote them and push them out of the window in time, and a run too short to time enough steps of any
        row count still adds to what the next one knows."""
        for rows, seconds in samples:
            self.observe(rows, seconds)

    def times(self, rows: int, most: int) -> list[float] | None:
        """Estimated seconds of a step of rows, rows + 1, ..., rows + most rows; None until they can be told."""
        if (rows, most) not in self._times:  # each sequence of a step asks
            self._times[rows, most] = self._estimate(rows, most)
        return self._times[rows, most]

    def _estimate(self, rows: int, most: int) -> list[float] | None:
        medians = self.medians()
        # a long prefill chunk runs in another regime: only row counts near those asked about
        near = [(n, t) for n, t in medians.items() if max(2, rows // 2) <= n <= 2 * (rows + most)]
        if len(near) == 1 and 1 in medians:
            near.append((1, medians[1]))
        line = None
        if len(near) >= 2:
            c, t = np.array(near).T
            # noise can tilt the line down: rows are then taken as free, which drafting tests again soon enough
            b = max(0.0, float(np.cov(c, t, bias=True)[0, 1] / np.var(c)))
            line = (float(t.mean() - b * c.mean()), b)
        out = [medians.get(n, line[0] + line[1] * n if line and n > 1 else None)
               for n in range(rows, rows + most + 1)]
        return None if None in out else out  # type: ignore[return-value]


@dataclass
class DraftState:
    """One sequence's drafting record: by place in a draft, how often a guess there was judged (every guess before
    it right) and how often it was right, decayed (see DECAY); and the engine's counts."""

    judged: list[float] = field(default_factory=list)
    right: list[float] = field(default_factory=list)
    checks: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def hits(self) -> float:
        return sum(self.right)

    @property
    def misses(self) -> float:
        """Guesses rejected: at most one a check, the rest of that draft never judged."""
        return sum(self.judged) - self.hits

    @property
    def acceptance(self) -> float:
        """The chance its next guess is right, were each guess right independently (a prior of one hit and one
        miss, which old evidence fades back to: text that stopped repeating its input may start again)."""
        return (self.hits + 1) / (self.hits + self.misses + 2)

    def acceptances(self, k: int) -> list[float]:
        """For the first k places of a draft, the chance a guess there is right once those before it were: each
        place's own record, drawn toward the pooled acceptance where it is thin. Guesses are not independent:
        copied text whose first guesses matched mostly matches on (the default model quoting a document: 69% of
        guesses right, but 6.5 tokens a check of eight), which a single acceptance prices at 4.9."""
        pooled = self.acceptance
        return [(self.right[i] + PRIOR_CHECKS * pooled) / (self.judged[i] + PRIOR_CHECKS) if i < len(self.judged)
                else pooled for i in range(k)]

    def fade(self) -> None:
        self.judged = [n * DECAY for n in self.judged]
        self.right = [n * DECAY for n in self.right]

    def add(self, drafted: int, accepted: int) -> None:
        """Count a check of `drafted` guesses whose first `accepted` were right."""
        judged = min(drafted, accepted + 1)
        while len(self.judged) < judged:
            self.judged.append(0.0)
            self.right.append(0.0)
        for i in range(judged):
            self.judged[i] += 1
            self.right[i] += i < accepted
        self.checks += 1
        self.drafted += drafted
        self.accepted += accepted


class Speculator:
    """Which sequences speculate, with which drafts, and what their acceptance and the steps' times teach."""

    def __init__(self, mode: str = "off", max_draft: int = MAX_DRAFT, cost: StepCost | None = None,
                 drafter: DraftModel | None = None):
        self.mode = check_mode(mode)
        if mode == "draft" and drafter is None:
            raise EdgeserveError("speculative mode 'draft' needs a draft model (--draft-model)")
        self.max_draft = max_draft
        self.cost = cost or StepCost()
        self.drafter = drafter
        self.drafted = 0  # every sequence's draft tokens so far
        self.accepted = 0
        self.verify_steps = 0  # sequence-steps that checked a draft
        self._since_try = {"ngram": 0, "model": 0}  # steps since "auto" last tried each drafter's advised-against draft

    def mode_for(self, seq: Sequence) -> str:
        """The request's own mode where it gave one, else the engine's."""
        return seq.params.speculative or self.mode

    def propose(self, seq: Sequence, room: int, rows: int, decodes: int) -> list[int]:
        """A draft for seq's next decode step, of at most room tokens (the step's budget and the request's
        remaining length allowing); [] where it should decode one token as usual. rows: the step's query rows
        without this draft (seq's own one counted); decodes: the sequences decoding in it. A draft model's draft
        is PENDING places, its room in the draft's pool taken: the model guesses them once the step is scheduled."""
        mode = self.mode_for(seq)
        most = min(room, self.max_draft)
        if mode == "off":
            return []
        if mode == "draft":
            return self._model_draft(seq, most)
        draft = lookup_draft(seq.token_ids, most)
        if mode == "ngram":
            return draft
        # each drafter's best draft and its expected tokens per second (a try: -1), the faster taken
        lookup = self._length("ngram", seq.draft_state, len(draft), rows, decodes, 0.0) if draft else (0, 0.0)
        model = (0, 0.0) if self.drafter is None else self._length(
            "model", seq.model_draft_state, most, rows, decodes, self.drafter.seconds_per_guess, fade=False)
        if model[0] and (not lookup[0] or model[1] > lookup[1]):
            return self._model_draft(seq, model[0])
        return draft[: lookup[0]]

    def _model_draft(self, seq: Sequence, k: int) -> list[int]:
        """k places for the draft model to fill, where its pool has room for them."""
        if k <= 0 or not self.drafter.reserve(seq, k):  # type: ignore[union-attr]
            return []
        return [PENDING] * k

    def _length(self, drafter: str, state: DraftState, most: int, rows: int, decodes: int, per_guess: float | None,
                fade: bool = True) -> tuple[int, float]:
        """How many of at most `most` guesses "auto" checks from `drafter`, given its acceptance record (state) and
        the seconds it takes to make one guess (None: not yet timed, so only a try drafts, which times it), and the
        step's expected tokens per second with them (-1 for a try). fade: the record fades at this step (prompt
        lookup's; a draft model's fades at its checks, see record)."""
        if fade:
            state.fade()
        times = self.cost.times(rows, most)
        k, rate = (0, 0.0) if times is None or per_guess is None else best_draft(state.acceptances(most), decodes,
                                                                              times, per_guess)
        # an estimate that never drafts could never learn otherwise: now and then, one short draft in a step (while an
        # estimate is missing, every other step, so the steps without it are timed too); far more rarely where even
        # guesses all right would not pay for the time they take to make (a draft model too slow here: its time is
        # measured again only so that one slow measurement cannot turn it off for good)
        due = EXPLORE_EVERY if times is not None and state.checks >= FIRST_CHECKS else 2
        if times is not None and per_guess is not None and best_draft([1.0] * most, decodes, times, per_guess)[0] == 0:
            due = HOPELESS_EVERY
        if k == 0 and self._since_try[drafter] >= due:
            self._since_try[drafter] = 0
            # a draft model's every other try as long as may be: its guesses are made one pass each, so the time of
            # a long check must be known to tell whether one pays (prompt lookup's drafts are as long as it finds)
            long_try = drafter == "model" and state.checks % 2 == 1
            return most if long_try else min(EXPLORE_DRAFT, most), -1.0
        return k, rate

    def learned(self) -> dict[str, Any]:
        """What this run measured of the machine, to start a later one from (engine/cost_memory.py)."""
        guess = None if self.drafter is None else self.drafter.seconds_per_guess
        return {"steps": self.cost.samples(), "seconds_per_guess": guess}

    def remember(self, data: dict[str, Any]) -> None:
        """Start from what earlier runs measured (`learned`); a file of another shape is ignored."""
        try:
            steps = [(int(n), float(t)) for n, t in data.get("steps", [])]
            guess = data.get("seconds_per_guess")
            guess = None if guess is None else float(guess)
        except (AttributeError, TypeError, ValueError):
            return
        self.cost.seed([(n, t) for n, t in steps if n > 0 and 0 < t < float("inf")])
        drafter = self.drafter
        if drafter is not None and drafter.seconds_per_guess is None and guess is not None and 0 < guess < float("inf"):
            drafter.seconds_per_guess = guess

    def observe(self, rows: int, seconds: float) -> None:
        """Record a step's model time and its query rows."""
        self.cost.observe(rows, seconds)
        for drafter in self._since_try:
            self._since_try[drafter] += 1

    def record(self, seq: Sequence, drafted: int, accepted: int, by_model: bool = False) -> None:
        """Count a checked draft (by_model: the draft model's): accepted guesses are hits, the first rejected one
        (if any) a miss."""
        state = seq.model_draft_state if by_model else seq.draft_state
        if by_model:
            # a draft model's acceptance changes little with the text, and where it does not pay it is checked only
            # now and then: faded at every step, its record would forget it between two tries
            state.fade()
        state.add(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1


def best_draft(alphas: list[float], decodes: int, times: list[float], per_guess: float = 0.0) -> tuple[int, float]:
    """The draft length k, 0..len(times) - 1, that maximizes the step's expected tokens per second, and that rate
    (0 unless it beats no draft by MARGIN), guess i right with probability alphas[i] once those before it were; the
    step takes times[k] seconds with it, and each guess per_guess seconds more to make (a draft model's forward
    pass; prompt lookup's are free).

    The step without this draft (times[0]) is taken to give one token per decoding sequence: drafts chosen
    earlier in the step count in its rows but not in its tokens, and prefill chunks scheduled after the decodes
    in neither, which both err toward drafting a little more than pays."""
    ks = np.arange(len(times))
    # a draft of k gives 1 + a0 + a0 a1 + ... + a0 ... a(k-1) tokens: the first wrong guess ends the run, and its row
    # (or the last) still samples one
    tokens = np.concatenate(([1.0], 1 + np.cumsum(np.cumprod(alphas[: len(times) - 1]))))
    rates = (decodes - 1 + tokens) / np.maximum(np.asarray(times) + per_guess * ks, 1e-12)
    k = int(np.argmax(rates))
    return (k, float(rates[k])) if rates[k] > (1 + MARGIN) * rates[0] else (0, float(rates[0]))
