"""Constrained decoding: a request's grammar (JSON Schema, regex, Lark) as a token mask on its row's logits.

llguidance compiles each grammar once (cached by its text) and keeps one matcher per request. The
masks of a step are computed on a worker thread while the model runs, then applied to the
constrained rows only, so constrained and free requests share every batched step.
"""

from __future__ import annotations

import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgeserve.engine.json_numbers import NumberBound, NumberScanner
from edgeserve.engine.sequence import Sequence
from edgeserve.sampling_params import (
    JSON_OPTIONS,
    OPENING_BLANKS,
    GrammarTrigger,
    InvalidParamsError,
    SamplingParams,
)
from edgeserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where a grammar is compiled: ~15 ms of every start, and most runs constrain nothing
    import llguidance

# A masked logit: far below any real one, finite so penalties, temperatures and logprobs stay finite.
MASKED_LOGIT = -1e30
GRAMMAR_CACHE_SIZE = 256
# A grammar's text, schema or tools included, past which it is refused: far above any tool set or answer schema,
# and what a compile costs grows with it (a 15,000-property schema takes seconds, and its compiled form ~40 MiB).
MAX_GRAMMAR_CHARS = 200_000
GRAMMAR_COMPLETE = ("EndOfSentence", "NoExtension")  # llguidance's stop reasons where the output is whole
_PARAM = {"json_schema": "json_schema", "regex": "regex", "lark": "grammar"}


def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar for a constraint (kind "json_schema", "regex" or "lark"); InvalidParamsError if malformed."""
    import llguidance

    if kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidParamsError(f"json_schema is not a JSON object: {exc}", "json_schema") from exc
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.LLMatcher.grammar_from_lark(source)


def _first_line(error: str) -> str:
    """An llguidance error's first line, without the grammar and parser state it dumps after it."""
    return error.strip().splitlines()[0][:300] if error.strip() else "no detail given"


def _finished(matcher: llguidance.LLMatcher) -> bool:
    """Whether the matcher's grammar is complete; InvalidParamsError where it stopped without being so (a budget of
    llguidance's ran out): the answer fails rather than end as if it were done."""
    if not matcher.is_stopped():
        return False
    reason = matcher.stop_reason()
    if reason not in GRAMMAR_COMPLETE:
        raise InvalidParamsError(f"the grammar could not be followed ({reason}): it is too large or too deep")
    return True


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The model's vocabulary for llguidance, with a mask bit for each of the model's `vocab_size` logits."""
    import llguidance

    eos = sorted(tokenizer.eos_token_ids)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        path = Path(folder) / "tokenizer.json"
        if path.exists():
            return llguidance.LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SentencePieceVocab(tokenizer, eos)),
                                  n_vocab=vocab_size, eos_token=eos)


class _SentencePieceVocab:
    """A SentencePiece vocabulary as the token bytes llguidance's TokenizerWrapper reads."""

    def __init__(self, tokenizer: Tokenizer, eos: list[int]):
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self.tokens = [self._bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self._tokenizer = tokenizer

    @staticmethod
    def _bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
        piece = tokenizer.id_to_token(token_id) or ""
        if tokenizer.is_special(token_id):
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # a byte-fallback piece
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


class Constraints:
    """The grammars of the requests in flight: compile (cached), mask their rows, advance them by their tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles off the engine thread
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._numbers: dict[str, NumberScanner] = {}  # where the JSON of each request whose grammar writes some stands
        self._waiting: dict[str, _Trigger] = {}  # requests whose grammar binds once their trigger is written
        self._openings: dict[str, GrammarTrigger] = {}  # bound requests whose grammar is let go unless they open so
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="edgeserve-masks")

    @cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # about a second to build: only once a request asks for a grammar
        return ll_tokenizer(self._tokenizer, self.vocab_size)

    @cached_property
    def _number_bound(self) -> NumberBound:
        return NumberBound(self._token_bytes, min(self.vocab_size, self.ll_tokenizer.vocab_size))

    def _token_bytes(self, token: int) -> bytes:
        """A token's text as bytes; none for a special token."""
        return b"" if self.ll_tokenizer.is_special_token(token) else self.ll_tokenizer.decode_bytes([token])

    @cached_property
    def _executor(self) -> llguidance.LLExecutor:
        import llguidance

        return llguidance.LLExecutor()

    def compile(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's grammar (compiled once per grammar text), or None if it has none.

        Raises InvalidParamsError, naming the parameter, when the grammar is invalid.
        """
        constraint = params.constraint
        if constraint is None:
            return None
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
        if template is None:
            template = self._build(*constraint)
            with self._lock:
                self._compiled[constraint] = template
                while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return template.deep_copy()

    @property
    def num_compiled(self) -> int:
        """Grammars compiled and kept."""
        return len(self._compiled)

    def _build(self, kind: str, source: str) -> llguidance.LLMatcher:
        import llguidance

        param = _PARAM[kind]
        if len(source) > MAX_GRAMMAR_CHARS:
            raise InvalidParamsError(f"{param} is {len(source)} characters long; at most {MAX_GRAMMAR_CHARS} are "
                                     "compiled", param)
        grammar = grammar_text(kind, source)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise InvalidParamsError(f"invalid {param}: {error.strip()}", param)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParamsError(f"invalid {param}: {_first_line(matcher.get_error())}", param)
        # llguidance's budgets run out at a mask, which validation does not compute: a schema's $ref cycle at the
        # first, the lexer's expressions (`a{1000000}`) or a parser row's items (thousands of alternatives that
        # share a first token) at the next. Walked here on a copy, through one token, such a grammar is a 400
        # naming the parameter instead of a request failing once admitted.
        probe = matcher.deep_copy()
        mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8)
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little")[: self.vocab_size])
        if not probe.is_error() and allowed.size and probe.consume_token(int(allowed[0])):
            probe.compute_bitmask()
        if probe.is_error():
            raise InvalidParamsError(f"{param} exceeds what the grammar engine can follow: "
                                     f"{_first_line(probe.get_error())}", param)
        return matcher

    def add(self, request_id: str, params: SamplingParams) -> None:
        matcher = self.compile(params)
        if matcher is None:
            return
        trigger = params.grammar_trigger
        if trigger is not None and not trigger.opening:
            self._waiting[request_id] = _Trigger(matcher, trigger)
            return
        self._bind(request_id, matcher, params.constraint)
        if trigger is not None:
            self._openings[request_id] = trigger

    def _bind(self, request_id: str, matcher: llguidance.LLMatcher, constraint: tuple[str, str]) -> None:
        self._matchers[request_id] = matcher
        kind, source = constraint
        # JSON Schemas, and Lark grammars that embed one (tool calls), write JSON whose numbers are bounded.
        if kind == "json_schema" or (kind == "lark" and "%json" in source):
            self._numbers[request_id] = NumberScanner()

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._numbers.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._openings.pop(request_id, None)

    def masks(self, request_id: str) -> bool:
        """Whether the request's next token is masked by its grammar: bound, not waiting for its trigger (its tokens
        are then free, and only watched once sampled)."""
        return request_id in self._matchers

    def constrained(self, request_id: str) -> bool:
        """Whether the request has a grammar, bound or waiting for its trigger."""
        return request_id in self._matchers or request_id in self._waiting

    def start_masks(self, seqs: list[Sequence]) -> Future | None:
        """Start computing the masks of the constrained rows among seqs (row i is seqs[i]); None if none is."""
        rows = [(m, i) for i, seq in enumerate(seqs) if (m := self._matchers.get(seq.request_id)) is not None]
        if not rows:
            return None
        return self._worker.submit(self._fill, rows, len(seqs))

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], num_rows: int) -> tuple[list[int], np.ndarray]:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(num_rows, self.vocab_size)
        fill_next_token_bitmask_par(self._executor, rows, bitmask)  # llguidance's threads, without the GIL
        return [i for _, i in rows], bitmask

    def apply(self, logits: np.ndarray, pending: Future | None, seqs: list[Sequence]) -> dict[int, str]:
        """Set the logits the constrained rows' grammars forbid to MASKED_LOGIT, in place.

        Returns the rows whose masks could not be computed, with why: those requests fail, the rest go on.
        """
        masks, failed = self.forbidden(pending, seqs)
        for row, mask in masks.items():
            np.copyto(logits[row], MASKED_LOGIT, where=mask)
        return failed

    def forbidden(self, pending: Future | None, seqs: list[Sequence]) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """The tokens each constrained row's grammar forbids (bool [vocab_size]), by row (row i is seqs[i]), and
        the rows whose masks could not be computed, with why."""
        if pending is None:
            return {}, {}
        try:
            rows, bitmask = pending.result()
        except Exception as exc:  # the grammar engine failing must not fail the free rows
            return {}, {i: f"grammar mask failed: {exc}" for i, seq in enumerate(seqs)
                        if seq.request_id in self._matchers}
        forbidden = np.unpackbits(~bitmask[rows].view(np.uint8), axis=1, bitorder="little").view(bool)
        return {row: self._bound_numbers(seqs[row].request_id, mask[: self.vocab_size])
                for row, mask in zip(rows, forbidden)}, {}

    def _bound_numbers(self, request_id: str, mask: np.ndarray) -> np.ndarray:
        """mask, also forbidding the tokens that would run a number past its digits, where others remain."""
        scanner = self._numbers.get(request_id)
        if scanner is None or not scanner.in_number:
            return mask
        too_long = self._number_bound.forbidden(scanner)
        bounded = mask.copy()
        bounded[: len(too_long)] |= too_long
        # The grammar may need a digit (a minimum not yet reached): then its mask stands alone.
        return mask if bounded.all() else bounded

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance seq's grammar by its sampled token; True when the grammar is complete.

        Raises InvalidParamsError when the token breaks the grammar (the request then fails alone).
        """
        waiting = self._waiting.get(seq.request_id)
        if waiting is not None:
            return self._watch(seq, waiting, token)
        matcher = self._matchers.get(seq.request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            raise InvalidParamsError(f"the output left its grammar: {_first_line(matcher.get_error())}")
        opening = self._openings.get(seq.request_id)
        if opening is not None and not self._opens_with(seq.request_id, opening, token):
            return False
        self._scan(seq.request_id, [token])
        return _finished(matcher)

    def _opens_with(self, request_id: str, trigger: GrammarTrigger, token: int) -> bool:
        """Follow the opening of a request whose grammar holds only if it opens with its trigger: False once it has
        opened otherwise, and its grammar is let go."""
        head = self._token_bytes(token).lstrip(OPENING_BLANKS.encode())
        if token == trigger.token_id or (head and trigger.text is not None and head.startswith(trigger.text.encode())):
            del self._openings[request_id]
            return True
        if not head and not self.ll_tokenizer.is_special_token(token):
            return True  # blank so far: the opening is still to come
        self.drop(request_id)
        return False

    def _scan(self, request_id: str, tokens: list[int]) -> None:
        scanner = self._numbers.get(request_id)
        for token in tokens if scanner is not None else ():
            scanner.feed(self._token_bytes(token))

    def _watch(self, seq: Sequence, waiting: _Trigger, token: int) -> bool:
        """Note the token of a request waiting for its trigger; once written, bind the grammar from the token where
        it begins. True when the grammar is then complete."""
        start = waiting.add(token, self._token_bytes(token))
        if start is None:
            return False
        del self._waiting[seq.request_id]
        tokens = waiting.tokens[start:]
        if not waiting.matcher.consume_tokens(tokens):
            raise InvalidParamsError(f"the output left its grammar: {_first_line(waiting.matcher.get_error())}")
        self._bind(seq.request_id, waiting.matcher, seq.params.constraint)
        self._scan(seq.request_id, tokens)
        return _finished(waiting.matcher)


class _Trigger:
    """A request's output while its grammar waits for the trigger: its tokens and where each one's bytes start."""

    def __init__(self, matcher: llguidance.LLMatcher, trigger: GrammarTrigger):
        self.matcher = matcher
        self.trigger_text = trigger.text.encode() if trigger.text else None
        self.trigger_token = trigger.token_id
        self.tokens: list[int] = []
        self.starts: list[int] = []
        self.text = bytearray()

    def add(self, token: int, data: bytes) -> int | None:
        """Take the next token (its bytes); once the trigger is written, the index of the token it begins in."""
        self.tokens.append(token)
        if token == self.trigger_token:
            return len(self.tokens) - 1
        if self.trigger_text is None:
            return None
        self.starts.append(len(self.text))
        self.text += data
        # Only the newest bytes, and the trigger's length before them, can complete it.
        at = self.text.find(self.trigger_text, max(0, self.starts[-1] - len(self.trigger_text) + 1))
        return None if at < 0 else max(i for i, start in enumerate(self.starts) if start <= at)
