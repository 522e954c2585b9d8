"""Speculative decoding's drafting side: guessing a sequence's next tokens, and drafting only where it pays.

Prompt lookup (n-gram) drafting needs no second model: the last n tokens of a sequence are looked up in its
prompt and output so far, and the tokens that followed their most recent earlier occurrence are the draft; and
first in the answers the engine finished before (SharedLookup), where a regenerated answer, an agent's next
edit of the same file or the same form filled again finds what its text repeats.
A decode step then checks the draft in one pass (see LLMEngine): each guess is one more query row. A draft model
(engine/drafter.py) guesses where no text repeats, at the cost of its own forward passes: the scheduler decides
how long each sequence's draft is, and the draft model makes all of a step's drafts at once once it is scheduled.

What a row costs depends on the machine and the batch: while a step is bound by reading the weights (one
stream on a CPU, most batches on a GPU) extra rows are nearly free; a CPU step of a 1B model is compute-bound
from about two rows on, where each row costs about half a one-row step; float32 weights on BLAS take twice as
long for two rows as for one, and little more for nine. So "auto" measures it: StepCost keeps the median time
of each row count the engine ran, and each draft is as long as maximizes the step's expected tokens per second,
given the sequence's measured acceptance (0 tokens, no draft, where none pays by a margin); with a draft model
too, the drafter whose draft promises more. Estimates from noisy step times can be wrong where the margin is thin,
so DraftJudge also compares what whole steps with drafts and without actually gave at each batch size, and vetoes
drafting where it lost.

Modes: "off"; "ngram" drafts whenever a match is found, as long as it may; "draft" drafts with the draft model
every step, as long as it may; "auto" as above, with the draft model where prompt lookup finds nothing worth
checking, its time per guess counted in the step's.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgeserve.config import SPECULATIVE_MODES
from edgeserve.errors import EdgeserveError

if TYPE_CHECKING:
    from edgeserve.engine.drafter import DraftModel
    from edgeserve.engine.scheduler import ScheduledSeq
    from edgeserve.engine.sequence import Sequence

MAX_DRAFT = 8  # tokens one draft may hold
NGRAM_MAX = 3  # longest suffix looked up first
NGRAM_MIN = 1
SHARED_NGRAM = 4  # tokens a lookup in other requests' answers matches: more than within one, as it is less specific
SHARED_ENTRIES = 1 << 15  # n-grams the shared table keeps, the least recently written dropped first (~10 MB)
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
JUDGE_WINDOW = 256  # recent decode steps of each batch size the judge compares
JUDGE_MIN = 6  # steps with drafts, and without, before the judge trusts their comparison
JUDGE_EVERY = 8  # a step in so many goes without drafts while the judge does not know yet whether they pay
# and, once it knows, a step in so many goes against its verdict: one with drafts where they lose costs what they lose
# (one in 8 cost 16 streams of the default model 3-5% against one in 32), one without where they pay what they gain
JUDGE_EVERY_KNOWN = 32
JUDGE_MARGIN = 0.03  # more tokens a second steps with drafts must give to be judged to pay: the default is not to draft


def sorted_median(values: list[float]) -> float:
    """The median of values already sorted, read rather than sorted for."""
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def check_mode(mode: str) -> str:
    if mode not in SPECULATIVE_MODES:
        raise EdgeserveError(f"unknown speculative mode {mode!r} (choose from {', '.join(SPECULATIVE_MODES)})")
    return mode


class PromptLookup:
    """Prompt lookup over one sequence's tokens: up to k tokens that followed the most recent earlier occurrence of
    its last n tokens (the longest n from n_max down to n_min that occurs). Every n-gram that has a token after it
    is indexed as the tokens grow, so a lookup costs a few dict reads where scanning the tokens cost ~60 us a
    sequence a step (16 streams of the default model: 1 ms of a 20 ms step)."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN):
        self.n_max, self.n_min = n_max, n_min
        self._tokens: list[int] | None = None
        self._indexed = 0  # tokens[:_indexed] are in _last
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence with a token after it ends

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The draft for tokens (the sequence's, grown since the last call, or another list: indexed anew)."""
        if tokens is not self._tokens or len(tokens) < self._indexed:
            self._tokens, self._indexed, self._last = tokens, 0, {}
        size = len(tokens)
        # an n-gram ending at `end` is indexed once a token follows it; the latest occurrence overwrites earlier ones
        for end in range(max(self._indexed - 1, 0), size - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._last[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = size
        if k <= 0:
            return []
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            end = self._last.get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class SharedLookup:
    """The n-grams of the answers an engine finished, each with the tokens that followed its latest occurrence
    (llama.cpp shares such a table across its slots too). An answer's first n-grams reach back into its prompt, so
    a request ending as an earlier one did gets that answer's first tokens as its guess."""

    def __init__(self, n: int = SHARED_NGRAM, capacity: int = SHARED_ENTRIES, k: int = MAX_DRAFT):
        self.n, self.capacity, self.k = n, capacity, k
        self._next: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: list[int], start: int) -> None:
        """Index the answer tokens[start:] (a finished sequence's, start its prompt's length)."""
        n, k, table = self.n, self.k, self._next
        for end in range(max(start - 1, n - 1), len(tokens) - 1):
            key = tuple(tokens[end - n + 1 : end + 1])
            table[key] = tuple(tokens[end + 1 : end + 1 + k])
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed tokens' last n in an answer indexed, or []."""
        if k <= 0 or len(tokens) < self.n:
            return []
        return list(self._next.get(tuple(tokens[-self.n :]), ())[:k])


class StepCost:
    """A step's time by its query rows: the median of the recent steps with as many rows, else read off the line
    through the medians of the nearby row counts above one (one row runs other kernels than several: a
    matrix-vector product, the decode kernels), else, with a single such count, the line from one row to it. A line
    through all counts, one row's included, told a 9-row step's time at twice what it was."""

    def __init__(self, window: int = COST_WINDOW):
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._by_rows: dict[int, list[float]] = {}  # the window's step times by row count, sorted
        self._medians: dict[int, float] = {}  # by row count, of those with enough steps to trust
        self._times: dict[tuple[int, int], list[float] | None] = {}  # times() asked since the last step, by its arguments

    def observe(self, rows: int, seconds: float) -> None:
        # only the row counts the step added and pushed out of the window change: their medians alone are taken again
        # (kept sorted, so that a median is read, not sorted for: every step observes)
        if len(self._samples) == self._samples.maxlen:
            old, t = self._samples[0]
            times = self._by_rows[old]
            del times[bisect.bisect_left(times, t)]
            self._remedian(old)
        self._samples.append((rows, seconds))
        bisect.insort(self._by_rows.setdefault(rows, []), seconds)
        self._remedian(rows)
        self._times = {}

    def _remedian(self, rows: int) -> None:
        ts = self._by_rows[rows]
        if len(ts) >= MIN_SAMPLES:
            self._medians[rows] = sorted_median(ts)
        else:
            self._medians.pop(rows, None)

    def medians(self) -> dict[int, float]:
        """The median step time of each row count with enough recent steps to trust it."""
        return dict(self._medians)

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
        medians = self._medians
        # a long prefill chunk runs in another regime: only row counts near those asked about
        near = [(n, t) for n, t in medians.items() if max(2, rows // 2) <= n <= 2 * (rows + most)]
        if len(near) == 1 and 1 in medians:
            near.append((1, medians[1]))
        line = None
        if len(near) >= 2:  # least squares, in plain Python: a few dozen points, asked once or twice a step
            mc = sum(n for n, _ in near) / len(near)
            mt = sum(t for _, t in near) / len(near)
            var = sum((n - mc) ** 2 for n, _ in near)
            # noise can tilt the line down: rows are then taken as free, which drafting tests again soon enough
            b = max(0.0, sum((n - mc) * (t - mt) for n, t in near) / var)
            line = (mt - b * mc, b)
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


class DraftJudge:
    """Whether drafting pays in a batch of so many decoding sequences, by what it did: the median tokens per second
    of recent decode steps with drafts against those without, whole steps (scheduling, drafting, sampling and
    checking too). The step-time estimates that size each draft are read off a line through noisy medians: at 16
    streams of the default model on a 2-core CPU a step is compute-bound (~1.3 ms a row) and a checked guess returns
    less than a token, but a line tilted flat by the machine's swings priced extra rows as nearly free, and "auto"
    drafted in 95% of the steps, 10% slower than without. So one step in JUDGE_EVERY_KNOWN goes against the verdict
    (and, while there is none, one in JUDGE_EVERY without drafts), keeping both sides measured at the same time.

    A "no" formed while guesses missed (an answer's opening, before it starts copying its input) stood for
    JUDGE_EVERY_KNOWN steps at a time while the text turned to repeating: one stream of the default model rewriting a
    code file went without drafts in 61 of its 85 steps, 30-40% slower than prompt lookup drafting at every step. So
    a step that drafted against a "no" and gave more tokens a second than the steps without drafts is followed by
    another with drafts, and so on while they gain, until the verdict turns; and a step whose only drafts are tries
    (Speculator._length's, made to time rows) is not judged at all (the same file: 48-54 steps, as fast as prompt
    lookup)."""

    def __init__(self) -> None:
        self._steps: dict[int, deque[tuple[bool, float]]] = {}  # by decoding sequences: (with drafts, tokens a second)
        # the window's rates of steps without drafts and with, kept sorted as steps come and go: every step reads their
        # medians, which sorting 256 steps each time made ~45 us of a 3 ms step
        self._sorted: dict[int, tuple[list[float], list[float]]] = {}
        self._counts: dict[int, int] = {}  # steps recorded at each batch size
        self._allowed: dict[int, bool] = {}  # allows() since the last step, by batch size: every sequence asks
        self._again: dict[int, bool] = {}  # batch sizes whose last step drafted against a "no" and gained

    def record(self, decodes: int, drafted: bool, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-9)
        self._again[decodes] = drafted and self._gains_against_no(decodes, rate)
        steps = self._steps.setdefault(decodes, deque(maxlen=JUDGE_WINDOW))
        rates = self._sorted.setdefault(decodes, ([], []))
        if len(steps) == steps.maxlen:
            old_drafted, old_rate = steps[0]
            del rates[old_drafted][bisect.bisect_left(rates[old_drafted], old_rate)]
        steps.append((drafted, rate))
        bisect.insort(rates[drafted], rate)
        self._counts[decodes] = self._counts.get(decodes, 0) + 1
        self._allowed = {}

    def _rates(self, decodes: int) -> tuple[list[float], list[float]]:
        """The recent tokens a second of steps of `decodes` sequences without drafts, and with, each sorted."""
        return self._sorted.get(decodes, ([], []))

    @staticmethod
    def _verdict(without: list[float], with_drafts: list[float]) -> bool | None:
        if min(len(without), len(with_drafts)) < JUDGE_MIN:
            return None
        return sorted_median(with_drafts) > (1 + JUDGE_MARGIN) * sorted_median(without)

    def pays(self, decodes: int) -> bool | None:
        """Whether steps with drafts gave more tokens a second than steps without; None until both are measured."""
        return self._verdict(*self._rates(decodes))

    def _gains_against_no(self, decodes: int, rate: float) -> bool:
        """Whether a step with drafts that gave `rate` tokens a second beat the steps without, where the verdict is
        "no" (read from the recent steps once: a drafted step asks, every step of every mode records)."""
        without, with_drafts = self._rates(decodes)
        return self._verdict(without, with_drafts) is False and rate > (1 + JUDGE_MARGIN) * sorted_median(without)

    def allows(self, decodes: int) -> bool:
        """Whether this step may draft (the same answer for every sequence of a step)."""
        if decodes not in self._allowed:
            verdict = self.pays(decodes)
            every = JUDGE_EVERY if verdict is None else JUDGE_EVERY_KNOWN
            against = self._counts.get(decodes, 0) % every == every - 1
            self._allowed[decodes] = (verdict is not False) != against or self._again.get(decodes, False)
        return self._allowed[decodes]


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
        self.judge = DraftJudge()
        self.shared = SharedLookup()
        # the sequences whose draft in the step being scheduled is a try (see _length): it learns what rows cost,
        # and says nothing of whether the drafts "auto" chooses pay, which the judge weighs
        self._trying: set[Sequence] = set()

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
        if mode == "auto" and (not self.judge.allows(decodes) or seq.params.seed is not None and not seq.params.greedy):
            # a seeded request's draws follow its guesses (sampler.check_guess), which "auto" times: its answer would
            # change with the machine's speed
            return []
        # a match in an earlier answer first: its four tokens say more than three of the sequence's own, and where it
        # repeats such an answer it usually goes on doing so (own lookup is kept indexed either way)
        own = seq.lookup.draft(seq.token_ids, most)
        draft = self.shared.draft(seq.token_ids, most) or own
        if mode == "ngram":
            return draft
        # each drafter's best draft and its expected tokens per second (a try: -1), the faster taken
        lookup = self._length("ngram", seq.draft_state, len(draft), rows, decodes, 0.0) if draft else (0, 0.0)
        model = (0, 0.0) if self.drafter is None else self._length(
            "model", seq.model_draft_state, most, rows, decodes, self.drafter.seconds_per_guess, fade=False)
        use_model = bool(model[0]) and (not lookup[0] or model[1] > lookup[1])
        if (model if use_model else lookup)[1] < 0:
            self._trying.add(seq)
        return self._model_draft(seq, model[0]) if use_model else draft[: lookup[0]]

    def finished(self, seq: Sequence) -> None:
        """Keep a finished sequence's answer for other requests' guesses, if it speculated."""
        if self.mode_for(seq) != "off":
            self.shared.add(seq.token_ids, seq.num_prompt_tokens)

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
        if (k == 0 and self._since_try[drafter] >= due and times is not None and per_guess is not None
                and best_draft([1.0] * most, decodes, times, per_guess)[0] == 0):
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

    def step_done(self, scheduled: list[ScheduledSeq], tokens: int, seconds: float) -> None:
        """Tell the judge how a step went: its tokens and whole time, if every item in it decoded (a prefill chunk's
        time says nothing of drafting)."""
        if scheduled and all(item.samples and item.num_new_tokens == 1 + len(item.draft) for item in scheduled):
            drafts = [item.seq in self._trying for item in scheduled if item.draft]
            if not drafts or not all(drafts):  # a step of tries alone is neither
                self.judge.record(len(scheduled), bool(drafts), tokens, seconds)
        self._trying.clear()

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
    # a draft of k gives 1 + a0 + a0 a1 + ... + a0 ... a(k-1) tokens: the first wrong guess ends the run, and its row
    # (or the last) still samples one; a plain loop, as each sequence of each step asks (NumPy took 30 us a call)
    base = decodes / max(times[0], 1e-12)
    best_k, best = 0, base
    tokens = run = 1.0
    for k in range(1, len(times)):
        run *= alphas[k - 1]
        tokens += run
        rate = (decodes - 1 + tokens) / max(times[k] + per_guess * k, 1e-12)
        if rate > best:
            best_k, best = k, rate
    return (best_k, best) if best > (1 + MARGIN) * base else (0, base)
