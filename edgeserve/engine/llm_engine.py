"""The engine: requests in, one batched step at a time, per-request output deltas out."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeserve.backends import get_backend
from edgeserve.backends.numpy_backend import choose_weights_mode
from edgeserve.engine.block_manager import BlockManager, blocks_for
from edgeserve.text.chat_template import ChatTemplate
from edgeserve.text.detokenizer import IncrementalDetokenizer
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.engine.kv_pool import size_pool
from edgeserve.engine.model_runner import ModelRunner
from edgeserve.models.loader import LoadedModel, load_model
from edgeserve.engine.sampler import sample, token_logprobs
from edgeserve.sampling_params import SamplingParams
from edgeserve.engine.scheduler import ScheduledSeq, Scheduler
from edgeserve.engine.sequence import Sequence, SequenceStatus
from edgeserve.system import available_memory_bytes
from edgeserve.units import parse_size

DEFAULT_KV_MEMORY = "1GiB"


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
    ttft: float | None = None  # seconds from arrival to first token
    elapsed: float = 0.0  # seconds from arrival to this output
    error: str | None = None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    last_batch_tokens: int = 0
    last_batch_seqs: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0
    output_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_free: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preemptions: int = 0
    tokens_per_second: float = 0.0  # output tokens per second over the recent window

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def kv_budget_bytes(spec: str | int | None) -> int:
    """'2GiB', '512MB', a byte count, or a fraction of available memory such as '0.25' or '25%'."""
    spec = DEFAULT_KV_MEMORY if spec is None else spec
    if isinstance(spec, int):
        return spec
    text = str(spec).strip()
    fraction = None
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100
    elif text.replace(".", "", 1).isdigit() and float(text) < 1:
        fraction = float(text)
    if fraction is not None:
        if not 0 < fraction < 1:
            raise EdgeserveError(f"invalid KV memory fraction {spec!r}")
        return int(fraction * available_memory_bytes())
    return parse_size(text)


class LLMEngine:
    def __init__(
        self,
        model: LoadedModel,
        backend: str = "auto",
        weights: str = "auto",
        kv_memory: str | int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        static_batching: bool = False,
        max_model_len: int | None = None,
    ):
        self.model = model
        self.tokenizer = model.tokenizer
        if weights == "auto":
            weights = choose_weights_mode(model, available_memory_bytes())
        self.backend = get_backend(backend, weights=weights)
        self.pool_size = size_pool(model.args, kv_budget_bytes(kv_memory), block_size, self.backend.kv_dtype_bytes)
        self.runner = ModelRunner(model, self.backend, self.pool_size)
        self.block_manager = BlockManager(self.pool_size.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, static_batching)
        self.max_model_len = min(max_model_len or model.args.max_position_embeddings,
                                 model.args.max_position_embeddings)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._recent: list[tuple[float, int]] = []  # (time, output tokens) per step
        self.chat_template = ChatTemplate.for_tokenizer(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits (may exceed the tokenizer's vocabulary where the model pads it)."""
        return self.model.args.vocab_size

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> "LLMEngine":
        return cls(load_model(name), **kwargs)

    # requests -----------------------------------------------------------------

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the model's chat template and tokenize (BOS comes from the template)."""
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_bos=False)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise PromptTooLongError when the prompt cannot run even alone."""
        if not prompt_ids:
            raise EdgeserveError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens")
        need = blocks_for(n + 1, self.pool_size.block_size)
        if need > self.pool_size.num_blocks:
            raise PromptTooLongError(
                f"prompt has {n} tokens but the KV pool holds only {self.pool_size.tokens} tokens "
                f"({self.pool_size.num_blocks} blocks); raise --kv-memory")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        ids = self.tokenize_prompt(prompt)
        self.check_prompt(ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise EdgeserveError(f"duplicate request id {request_id!r}")
        room = self.max_model_len - len(ids)
        if params.max_tokens > room:
            params = SamplingParams(**{**params.__dict__, "max_tokens": room})
        seq = Sequence(request_id, ids, params)
        self.seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer)
        self._emitted[request_id] = 0
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output, if it was live."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self._finish(seq, "abort")
        return self._output(seq, [], [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # one step -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        if self.block_manager.pending_copies:
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies = []
        logits = self.runner.run(scheduled)
        sampling = [item.seq for item in scheduled if item.samples]
        tokens = sample(logits, sampling)
        st = self._stats
        st.steps += 1
        st.last_batch_seqs = len(scheduled)
        st.last_batch_tokens = sum(item.num_new_tokens for item in scheduled)
        for item in scheduled:
            seq = item.seq
            if item.padding:
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                st.prompt_tokens_computed += min(item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_full_blocks(seq)
        now = time.perf_counter()
        outputs = []
        for row, (seq, token) in enumerate(zip(sampling, tokens)):
            logprobs = []
            if seq.params.logprobs is not None:
                logprobs = [token_logprobs(logits[row], token, seq.params.logprobs)]
                seq.logprobs.extend(logprobs)
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            st.output_tokens += 1
            outputs.append(self._after_token(seq, token, logprobs))
        self._recent.append((now, len(sampling)))
        self._recent = [(t, n) for t, n in self._recent if now - t < 5.0]
        return outputs

    def _after_token(self, seq: Sequence, token: int, logprobs: list[dict]) -> RequestOutput:
        p = seq.params
        rid = seq.request_id
        stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids)
        if not stop_token:
            seq.output_text += self._detok[rid].add(token)
        reason = "stop" if stop_token else None
        if reason is None and p.stop:
            start = max(0, self._emitted[rid] - max(len(s) for s in p.stop))
            hits = [i for i in (seq.output_text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                seq.output_text = seq.output_text[: min(hits)]
                reason = "stop"
        if reason is None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            if reason == "length":
                seq.output_text += self._detok[rid].flush()
            self._finish(seq, reason)
        return self._output(seq, [token], logprobs)

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: list[dict]) -> RequestOutput:
        rid = seq.request_id
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1  # hold back what may start a stop string
        start = self._emitted[rid]
        end = max(end, start)
        self._emitted[rid] = end
        now = time.perf_counter()
        out = RequestOutput(
            request_id=rid,
            text=seq.output_text[start:end],
            token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            ttft=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            elapsed=now - seq.arrival_time,
            error=seq.error,
        )
        if seq.is_finished:
            del self.seqs[rid], self._detok[rid], self._emitted[rid]
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every position of token_ids [T, vocab], for scoring (perplexity, parity checks).

        Runs outside the scheduler, so call it only while no requests are in flight.
        """
        self.check_prompt(token_ids)
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise PromptTooLongError(f"{len(token_ids)} tokens do not fit in the free KV blocks")
        try:
            return self.runner.run([ScheduledSeq(seq, len(token_ids))], all_rows=True)
        finally:
            self.block_manager.free_seq(seq)

    def kv_map(self) -> list[tuple[str, list[str]]]:
        """Each pool block's state ('free', 'cached', 'used' or 'shared') and the requests holding it."""
        bm = self.block_manager
        owners: list[list[str]] = [[] for _ in range(bm.num_blocks)]
        for seq in self.scheduler.running:
            for b in seq.block_table:
                owners[b].append(seq.request_id)
        states = []
        for b, holders in enumerate(owners):
            if bm.ref_count[b] == 0:
                states.append(("cached" if bm.block_hash[b] is not None else "free", holders))
            else:
                states.append(("shared" if bm.ref_count[b] > 1 else "used", holders))
        return states

    # stats --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        st = self._stats
        bm = self.block_manager
        st.running = len(self.scheduler.running)
        st.waiting = len(self.scheduler.waiting)
        st.kv_blocks_total = bm.num_blocks
        st.kv_blocks_used = bm.num_used
        st.kv_blocks_cached = bm.num_cached
        st.kv_blocks_free = bm.num_free - st.kv_blocks_cached
        st.prefix_hit_tokens = bm.hit_tokens
        st.prefix_query_tokens = bm.query_tokens
        st.preemptions = self.scheduler.num_preemptions
        if len(self._recent) > 1:
            span = self._recent[-1][0] - self._recent[0][0]
            st.tokens_per_second = sum(n for _, n in self._recent[1:]) / span if span > 0 else 0.0
        return EngineStats(**st.__dict__)
