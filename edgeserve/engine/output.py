"""Between the engine and the front ends: each request's sampled tokens become text deltas.

Per request, one RequestState holds the incremental detokenizer, the text so far and how much of
it was sent, and decides when the request ends (stop tokens, stop strings, length limits).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from edgeserve.engine.sequence import Sequence
from edgeserve.text.detokenizer import IncrementalDetokenizer
from edgeserve.text.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    """What one step produced for one request: the new text and tokens, and whether it ended."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[dict] = field(default_factory=list)
    prefix_diverged_at: int | None = None  # the first prompt token no cached prefix had, if any
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)  # of num_cached_tokens, from each store tier
    ttft: float | None = None  # seconds from arrival to first token
    elapsed: float = 0.0  # seconds from arrival to this output
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended it, where one did


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request (several tokens of one step) as one."""
    last = outputs[-1]
    return dataclasses.replace(last, text="".join(o.text for o in outputs),
                               token_ids=[t for o in outputs for t in o.token_ids],
                               logprobs=[lp for o in outputs for lp in o.logprobs])


class RequestState:
    """One request's output side: its detokenizer, its text, what was sent, and why it ended."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer) -> None:
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""
        self.sent = 0  # characters of text already sent
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_string: str | None = None  # the stop string that ended it, where one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def _hold_back(self) -> int:
        """Characters that may start a stop string, so are not sent before the next token decides."""
        return max(len(s) for s in self.seq.params.stop) - 1 if self.seq.params.stop else 0

    def add_token(self, token: int, stop_token: bool, grammar_complete: bool, max_model_len: int) -> None:
        """Take the token just appended to the sequence: extend the text, and finish where it ends.

        grammar_complete: the token completed the request's grammar, so the request ends with it.
        """
        seq, p = self.seq, self.seq.params
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if stop_token:
            self.finish_reason = "stop"
            return
        self.text += self.detokenizer.add(token)
        if p.stop:
            start = max(0, self.sent - self._hold_back - 1)  # one may begin in the held-back tail
            hits = [(i, s) for s in p.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return
        if grammar_complete:
            self.text += self.detokenizer.flush()
            self.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
            self.text += self.detokenizer.flush()
            self.finish_reason = "length"

    def output(self, new_tokens: list[int], logprobs: list[dict]) -> RequestOutput:
        """The delta since the last output: text not sent yet, except a possible stop string's start."""
        seq = self.seq
        end = len(self.text) if self.finished else len(self.text) - self._hold_back
        start, self.sent = self.sent, max(end, self.sent)
        return RequestOutput(
            request_id=seq.request_id,
            text=self.text[start : self.sent],
            token_ids=new_tokens,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            prefix_diverged_at=seq.prefix_diverged_at,
            tier_cached_tokens=seq.tier_cached_tokens,
            ttft=None if self.first_token_time is None else self.first_token_time - seq.arrival_time,
            elapsed=time.perf_counter() - seq.arrival_time,
            stop_string=self.stop_string,
        )


class OutputProcessor:
    """The RequestStates of the requests in flight; a request's state goes with its final output."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._states: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        self._states[seq.request_id] = RequestState(seq, self.tokenizer)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def request_ids(self) -> list[str]:
        """The requests in flight, in the order they came."""
        return list(self._states)

    def sequence(self, request_id: str) -> Sequence | None:
        """The sequence of a request in flight, None once it has ended."""
        state = self._states.get(request_id)
        return None if state is None else state.seq

    def process(self, seq: Sequence, token: int, logprob: dict | None = None, grammar_complete: bool = False
                ) -> RequestOutput:
        """The output for the token just sampled for seq, with its logprobs entry (`sampler.token_logprobs`) where
        the request asks for them.

        grammar_complete: the token completed seq's grammar, which ends the request.
        """
        p = seq.params
        logprobs = [] if logprob is None else [logprob]
        stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids)
        state = self._states[seq.request_id]
        state.add_token(token, stop_token, grammar_complete, self.max_model_len)
        return self._emit(state, [token], logprobs)

    def abort(self, request_id: str) -> RequestOutput:
        """The final output of a request ended from outside."""
        state = self._states[request_id]
        state.finish_reason = "abort"
        return self._emit(state, [], [])

    def fail(self, request_id: str, message: str) -> RequestOutput:
        """The final output of a request that failed on its own (the rest of the batch goes on)."""
        out = self.abort(request_id)
        out.error = message
        return out

    def _emit(self, state: RequestState, new_tokens: list[int], logprobs: list[dict]) -> RequestOutput:
        out = state.output(new_tokens, logprobs)
        if out.finished:
            del self._states[out.request_id]
        return out


@dataclass
class Completion:
    """A request's outputs merged: all its text, tokens and logprobs, and how it ended."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft: float | None = None
    elapsed: float = 0.0
    logprobs: list[dict] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.num_prompt_tokens, self.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        self.ttft, self.elapsed = out.ttft, out.elapsed
        if out.finished:
            self.finish_reason = out.finish_reason
