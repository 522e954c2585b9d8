"""The engine: requests in, one batched step at a time, per-request output deltas out."""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

import numpy as np

from edgeserve.backends import get_backend
from edgeserve.batch import SamplingRows
from edgeserve.config import EngineConfig
from edgeserve.engine import cost_memory
from edgeserve.engine.block_manager import BlockManager, blocks_for
from edgeserve.engine.constraints import Constraints
from edgeserve.engine.drafter import DRAFT_KV_SHARE, DraftModel, check_vocabulary
from edgeserve.engine.kv_budget import size_pool
from edgeserve.engine.model_runner import ModelRunner
from edgeserve.engine.prefix_store import PrefixStore, namespace_key
from edgeserve.engine.output import Completion, OutputProcessor, RequestOutput, merge_outputs
from edgeserve.engine.sampler import check_guess, penalizes, penalty_rows, sample, token_logprobs
from edgeserve.engine.scheduler import ScheduledSeq, Scheduler
from edgeserve.engine.sequence import Sequence
from edgeserve.engine.speculative import PENDING, Speculator
from edgeserve.engine.step_profile import StepProfile
from edgeserve.errors import EdgeserveError, PromptTooLongError
from edgeserve.models.loader import LoadedModel, load_model, model_fingerprint
from edgeserve.sampling_params import InvalidParamsError, SamplingDefaults, SamplingParams

# decode steps of the same greedy rows run as one where a step's host work cannot hide behind the device's (`_burst`)
BURST = 4
RATE_WINDOW = 5.0  # seconds of recent steps the stats' tokens per second are measured over
# An embedding from a prompt's final hidden states [tokens, hidden], by the model's pooling (LoadedModel.pooling)
POOLING = {"mean": lambda rows: rows.mean(axis=0), "cls": lambda rows: rows[0], "last": lambda rows: rows[-1]}


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
    kv_tokens_stored: int = 0  # tokens whose K/V the running sequences hold
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_ram_hit_tokens: int = 0  # of prefix_hit_tokens, loaded from the prefix store's RAM tier
    prefix_disk_hit_tokens: int = 0  # and from its disk tier
    prefix_store_ram_bytes: int = 0  # K/V bytes the RAM tier holds
    prefix_store_disk_bytes: int = 0  # and the disk tier (every model's entries, as this engine counts them)
    preemptions: int = 0
    tokens_per_second: float = 0.0  # output tokens per second over the recent window
    draft_tokens: int = 0  # tokens speculative decoding guessed and checked
    accepted_draft_tokens: int = 0  # of those, how many were right (each one a token gained)
    draft_checks: int = 0  # decode steps of a sequence that checked a draft
    steps_launched_ahead: int = 0  # steps launched before the previous step's tokens reached the host

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class LaunchedAhead:
    """A decode step launched one step early: the sequences of the step running when it was launched, each one
    token on, their input tokens that step's samples (still on the device)."""

    seqs: list[Sequence]
    positions: list[int]  # each sequence's row's position
    tokens: Any  # its sampling rows' tokens, on the device
    generators: list[tuple[Sequence, dict]]  # the state of each drawing sequence's generator before its draw

    def drop(self) -> None:
        """Give back the draws it took: the step that replaces it draws them again."""
        for seq, state in self.generators:
            seq.rng.bit_generator.state = state

    def matches(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the scheduler asks for exactly this step."""
        return len(scheduled) == len(self.seqs) and all(
            item.seq is seq and item.num_new_tokens == 1 and not item.draft and item.first_position == pos
            for item, seq, pos in zip(scheduled, self.seqs, self.positions))


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is and what it takes, fixed once it is built: any thread may read it."""

    model_name: str  # the model's file or folder name
    backend: str  # the array backend's name
    context_len: int  # the model's context, capped by max_model_len where one was given
    max_model_len: int  # the most tokens one sequence may hold: the context, capped by the KV pool
    vocab_size: int  # rows of the model's embedding and logits (may exceed the tokenizer's vocabulary: padding)
    block_size: int  # tokens per KV block
    num_blocks: int  # blocks in the KV pool
    memory_bytes: int  # the weights as the backend holds them, and the KV pool (and a draft model's, where given)
    sampling_defaults: SamplingDefaults  # what requests sample with where they do not say
    architecture: str  # the model family ("llama", "qwen3", "gemma3_text", ...)
    model_format: str  # "gguf", "safetensors" or "mlx"
    num_parameters: int
    quantization: str  # e.g. "Q4_1 (4-bit, group 32) + Q8_0 embeddings"
    draft_model: str | None = None  # the draft model's name, where speculative decoding has one

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidParamsError, naming the parameter, where params ask for what this engine lacks: token ids
        outside its vocabulary, or drafting with a draft model it was built without."""
        params.check_vocab(self.vocab_size)
        if params.speculative == "draft" and self.draft_model is None:
            raise InvalidParamsError("speculative 'draft' needs a draft model, and this model is served without one "
                                     "(--draft-model)", "speculative")

    def check_prompt(self, prompt_ids: list[int], scored_only: bool = False) -> None:
        """Raise PromptTooLongError when the prompt cannot run even alone (with room for a token after
        it, unless it is only scored), EdgeserveError when it is empty or holds ids the model has no row for."""
        if not prompt_ids:
            raise EdgeserveError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise EdgeserveError(f"the prompt holds token ids outside the model's vocabulary (0..{self.vocab_size - 1})")
        n = len(prompt_ids)
        if n + (0 if scored_only else 1) > self.context_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens but the model's context is {self.context_len} tokens")
        if blocks_for(n + 1, self.block_size) > self.num_blocks:
            raise PromptTooLongError(
                f"prompt has {n} tokens but the KV pool holds only {self.num_blocks * self.block_size} tokens "
                f"({self.num_blocks} blocks); raise --kv-memory")


class LLMEngine:
    """`LLMEngine(model, EngineConfig(...))`; keyword arguments override single config fields. draft: a draft model
    for speculative decoding already loaded (else config.draft_model, where given, is loaded)."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, draft: LoadedModel | None = None,
                 **overrides: Any):
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = config
        self.model = model
        self.tokenizer = model.tokenizer
        self.populating: threading.Thread | None = None  # the thread mapping the KV pool's pages in (populate_kv)
        if config.distributed:
            from edgeserve.distributed.group import world  # MLX's: loaded only for a model split across ranks
            from edgeserve.distributed.runner import start_group

            self.backend, self.pool_size, self.runner = start_group(model, config, world())
        else:
            self.backend = get_backend(config.backend, weights=config.weights, model=model, threads=config.threads,
                                       activations=config.activations, kv_dtype=config.kv_dtype)
            self.pool_size = size_pool(model.args, config.kv_budget_bytes(), config.block_size, self.backend.kv_dtype)
            self.runner = ModelRunner(model, self.backend, self.pool_size)
            if config.populate_kv:
                self.populating = self.runner.kv.populate()
        self.prefix_store = self._open_prefix_store()
        self.block_manager = BlockManager(self.pool_size.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.prefix_store)
        self.drafter = self._load_drafter(draft)
        self.speculator = Speculator(config.speculative or self._default_speculative(), drafter=self.drafter)
        self._cost_key = None
        if config.remember_step_costs and not config.distributed:
            draft = None if self.drafter is None else self.drafter.model.source
            self._cost_key = cost_memory.cost_key(model.source, draft, self.backend.describe())
            if (learned := cost_memory.load(self._cost_key)) is not None:
                self.speculator.remember(learned)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.static_batching, self.speculator.propose,
                                   on_free=self.drafter.release if self.drafter is not None else None)
        context = model.args.max_position_embeddings
        self.context_len = min(config.max_model_len or context, context)
        # a longer sequence could never grow, even alone in the pool
        self.max_model_len = min(self.context_len, self.pool_size.tokens)
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.info = EngineInfo(
            model_name=model.source.name, backend=self.backend.name, context_len=self.context_len,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, block_size=self.pool_size.block_size,
            num_blocks=self.pool_size.num_blocks, memory_bytes=self._memory_bytes(),
            sampling_defaults=model.sampling_defaults, architecture=model.args.model_type, model_format=model.format,
            num_parameters=model.num_parameters, quantization=model.quantization(),
            draft_model=self.drafter.model.source.name if self.drafter is not None else None)
        self.constraints = Constraints(self.tokenizer, self.vocab_size)
        self._ids = itertools.count()
        self._stats = EngineStats()
        self.profile = StepProfile()
        self._ahead: LaunchedAhead | None = None
        # (time, output tokens) of each step of the last RATE_WINDOW seconds, and those tokens' sum: kept as they
        # come, since a list filtered at every step cost ~0.1 ms a step at 500 steps a second (and stats() as much)
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_tokens = 0

    def describe_limits(self) -> str | None:
        """A note when the KV pool caps the context below the model's, else None."""
        if self.max_model_len >= self.context_len:
            return None
        return (f"max_model_len capped to {self.max_model_len} tokens (the model's context is {self.context_len}): "
                f"one sequence can hold no more of the KV pool; raise --kv-memory for longer ones")

    def _load_drafter(self, draft: LoadedModel | None) -> DraftModel | None:
        """The draft model (given, or config.draft_model loaded) on a backend of the target's kind, with its own
        KV pool; None where there is none. Its vocabulary must be the target's."""
        config = self.config
        if draft is None and config.draft_model is None:
            return None
        draft = draft or load_model(config.draft_model)  # type: ignore[arg-type]
        check_vocabulary(self.tokenizer, draft.tokenizer, draft.source.name)
        backend = get_backend(self.backend.name, weights=config.weights, model=draft, threads=config.threads,
                              activations=config.activations, kv_dtype=config.kv_dtype)
        return DraftModel(draft, backend, int(DRAFT_KV_SHARE * config.kv_budget_bytes()), config.block_size,
                          self.vocab_size)

    def _default_speculative(self) -> str:
        """"auto" with a draft model, and on the NumPy backend, where it was measured never slower than "off" (one
        stream of open chat the same, 16 streams of mixed tasks 1.01x, answers that copy their input 2.2-3x); "off"
        on MLX (and so across ranks), where a step that checks guesses could not be launched ahead (GPU) or chained
        into a burst (CPU), as plain decoding there is."""
        return "auto" if self.drafter is not None or self.backend.name == "numpy" else "off"

    def _open_prefix_store(self) -> PrefixStore | None:
        """The prefix store's tiers where the config gives them room, in the namespace of what decides the K/V
        bytes: the model's files, how the backend computes, and the pool's block layout and depth."""
        ram, disk = self.config.prefix_cache_bytes()
        if not self.config.enable_prefix_caching or (ram <= 0 and disk <= 0):
            return None
        # the RAM tier lives and dies with this engine and its model: only the disk tier needs the files' digest
        files = model_fingerprint(self.model.source) if disk > 0 else ""
        # the thread count changes how rows are split, not the numbers
        compute = re.sub(r", \d+ threads?", "", self.backend.describe())
        dtype, shape = self.runner.block_layout
        namespace = namespace_key(files, compute, dtype.str, shape, self.model.args.num_hidden_layers)
        meta = {"model": self.model.source.name, "path": str(self.model.source), "backend": compute,
                "kv_dtype": self.backend.kv_dtype, "block_size": self.config.block_size}
        return PrefixStore(namespace, ram, disk, meta=meta)

    def close(self) -> None:
        """Keep the pool's prefixes in the prefix store's disk tier and finish its writes (an engine stopping:
        the next one starts from them), and the step times speculation measured where the config says so, then let
        go of the other ranks of a split model."""
        store = self.prefix_store
        if store is not None and store.disk_limit > 0:
            self._move_tiers()
            store.persist()  # the RAM tier first: the pool's blocks are the newer, the last a full disk evicts
            cached = self.block_manager.cached_blocks()
            for start in range(0, len(cached), 64):  # a slice at a time: the writer drains while the pool is read
                part = cached[start : start + 64]
                for (_, h, key), data in zip(part, self.runner.read_blocks([b for b, _, _ in part])):
                    store.save(h, key, data)
        if store is not None:
            store.close()
        if self._cost_key is not None and (learned := self.speculator.learned())["steps"]:
            cost_memory.save(self._cost_key, learned)
        self.runner.close()

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits (may exceed the tokenizer's vocabulary where the model pads it)."""
        return self.model.args.vocab_size

    def _memory_bytes(self) -> int:
        """The weights as the backend holds them (the NumPy backend may hold float32 copies) and the KV pool, and
        the draft model's where there is one."""
        runners = [(self.runner, self.pool_size)]
        if self.drafter is not None:
            runners.append((self.drafter.runner, self.drafter.pool_size))
        total = 0
        for runner, pool in runners:
            m = runner.model
            total += _nbytes([m.embed, m.norm, m.layers]) + (0 if m.lm_head is m.embed else _nbytes(m.lm_head))
            total += pool.bytes
        return total

    @classmethod
    def from_name(cls, name: str, config: EngineConfig | None = None, **overrides: Any) -> LLMEngine:
        return cls(load_model(name), config, **overrides)

    # requests -----------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: a text is encoded (with BOS where the model wants one), a list is taken as is."""
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def check_prompt(self, prompt_ids: list[int], scored_only: bool = False) -> None:
        """See EngineInfo.check_prompt."""
        self.info.check_prompt(prompt_ids, scored_only)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        self.info.check_params(params)
        ids = self.tokenize_prompt(prompt)
        self.check_prompt(ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output:
            raise EdgeserveError(f"duplicate request id {request_id!r}")
        self.constraints.add(request_id, params)
        room = self.max_model_len - len(ids)
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        seq = Sequence(request_id, ids, params)
        self.output.add(seq)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output, if it was live."""
        seq = self.output.sequence(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        self.constraints.drop(request_id)
        return self.output.abort(request_id)

    def request_ids(self) -> list[str]:
        """The requests in flight (waiting or running)."""
        return self.output.request_ids()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # one step -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, update the sequences, and return each sampled request's output."""
        began = time.perf_counter()
        self.profile.begin()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.profile.lap("schedule")
        drafts = [item for item in scheduled if item.draft[:1] == [PENDING]]
        if drafts:
            self.drafter.fill(drafts)  # type: ignore[union-attr]
            self.profile.lap("draft")
        outputs = self._device_step(scheduled) if self._sampled_on_device(scheduled) else self._host_step(scheduled)
        tokens = sum(len(out.token_ids) for out in outputs)
        self._count_outputs(tokens)
        # whether drafting pays in a batch like this one is judged by what whole steps gave
        self.speculator.step_done(scheduled, tokens, time.perf_counter() - began)
        return outputs

    def _host_step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """A step whose logits come to the host, sampled (and drafts checked) there."""
        self._drop_ahead()
        sampling = [item for item in scheduled if item.samples]
        plain = [item.seq for item in sampling if not item.draft]
        masks = self.constraints.start_masks(plain)  # computed while the model runs
        start = time.perf_counter()
        logits = self._run(scheduled)
        # what a step of so many rows costs on this machine decides how long drafts pay
        self.speculator.observe(sum(item.num_new_tokens for item in scheduled), time.perf_counter() - start)
        # each sampling item's first row of logits; one checking a draft has 1 + len(draft) rows
        first_rows = np.cumsum([0] + [1 + len(item.draft) for item in sampling])[:-1]
        if masks is None and len(plain) == len(logits):  # every row is a plain one, in order: no copy of them all
            plain_logits = logits
        else:  # a copy, which the grammars' masks then change
            plain_logits = logits[[r for item, r in zip(sampling, first_rows) if not item.draft]]
        unmasked = self.constraints.apply(plain_logits, masks, plain)
        tokens, failed = sample(plain_logits, plain)
        failed = {**failed, **unmasked}
        logprobs = self._logprobs(plain_logits, plain, tokens)
        self.profile.lap("sample")
        self._update(scheduled)
        outputs = []
        row = iter(range(len(plain)))
        for item, first in zip(sampling, first_rows):
            if item.draft:
                outputs.append(self._check_draft(item, logits[first : first + 1 + len(item.draft)]))
            else:
                i = next(row)
                outputs.append(self._output(item.seq, tokens[i], logprobs.get(i), failed.get(i)))
        self.profile.end("output")
        return outputs

    def _sampled_on_device(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the step's sampling rows can all draw their token on the backend's device: none checks a draft
        or asks for logprobs; plain greedy ones anywhere, sampled ones and those with a bias, a penalty or a
        grammar's mask where the device computes apart from the host (`computes_async`: elsewhere the host's
        sampler is as fast). A grammar waiting for its trigger (tool calls) masks nothing until it binds."""
        def on_device(seq: Sequence) -> bool:
            p = seq.params
            return p.logprobs is None and (
                (p.greedy and not penalizes(seq) and not self.constraints.masks(seq.request_id))
                or self.backend.computes_async)

        return all(not item.draft and (not item.samples or on_device(item.seq)) for item in scheduled)

    @staticmethod
    def _sampling_rows(seqs: list[Sequence], recent: Any = None, allowed: np.ndarray | None = None
                       ) -> SamplingRows | None:
        """How seqs' rows draw on the device, each sampled one with its generator's next number (as the host's
        sampler takes it), and their biases, penalties and grammars' masks (allowed); None where all are greedy
        and plain. recent: each sequence's latest token where it is still on the device (a step launched
        ahead)."""
        params = [seq.params for seq in seqs]
        penalized = any(penalizes(seq) for seq in seqs)
        if all(p.greedy for p in params) and not penalized and allowed is None:
            return None
        return SamplingRows(
            temperature=np.array([0.0 if p.greedy else p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int64),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            uniform=np.array([0.0 if p.greedy else seq.rng.random() for seq, p in zip(seqs, params)]),
            penalties=penalty_rows(seqs, ahead=recent is not None) if penalized else None,
            recent=recent if penalized else None,
            allowed=allowed)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.drop()
            self._ahead = None

    def _device_step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """A step sampled on the device. While the device computes it, the host builds the next step where that
        can only be the same sequences one token on (their tokens this step's samples, still on the device), and
        launches it as soon as this one is done, before this step's outputs are processed; the scheduler's next
        step takes it if it asks for exactly that (nobody finished, joined or drafted), and otherwise it is
        dropped: its K/V at the slot after each row's is written again before anything reads it, and the numbers
        its sampled rows drew go back to their generators.

        It is launched at once where the backend writes K/V through the pool's pointer (`launch_early`: the
        device then always has the next step queued); elsewhere only once this step is done, because MLX's own
        pool writes update it in place only once nothing else in flight still uses it (else each write would
        copy the whole pool).

        Rows whose grammar masks their token take the mask (computed on the host) to the device; no step is
        launched ahead of them, whose next mask depends on the token this step samples."""
        sampling = [item.seq for item in scheduled if item.samples]
        pending = self.constraints.start_masks(sampling)  # computed while the pool is prepared
        failed: dict[int, str] = {}
        start = None  # when this step was launched, for its model time
        if (self._ahead is not None and pending is None and self._ahead.matches(scheduled)
                and not self.block_manager.has_pending_moves()):
            tokens = self._ahead.tokens
            self._ahead = None
            self._stats.steps_launched_ahead += 1
            self.profile.lap("batch")
        else:
            self._drop_ahead()
            steps = self._burst_steps(scheduled)
            if steps > 1:
                return self._burst(scheduled, steps)
            self._prepare_pool()
            allowed = None
            if pending is not None:
                allowed, failed = self._allowed_tokens(sampling, pending)
                self.profile.lap("sample")
            start = time.perf_counter()
            tokens = self.runner.sampled_tokens(scheduled, self._sampling_rows(sampling, allowed=allowed),
                                                profile=self.profile)
            self.backend.launch(tokens)
            self.profile.lap("eval")  # a backend computing on the host (MLX on the CPU) computes here
        ahead = None
        if self.backend.computes_async and pending is None and len(sampling) == len(scheduled) and all(
                item.num_new_tokens == 1 and self._room_after_next(item.seq) for item in scheduled):
            ahead = self._build_ahead(sampling, tokens)
            if ahead is not None and self.backend.launch_early:
                self.backend.launch(ahead.tokens)
        sampled = self.backend.fetch_tokens(tokens)
        self.profile.lap("eval")
        if start is not None:  # what a step of so many rows costs on this machine decides how long drafts pay
            self.speculator.observe(sum(item.num_new_tokens for item in scheduled), time.perf_counter() - start)
        if ahead is not None and not self.backend.launch_early:
            self.backend.launch(ahead.tokens)
            self.profile.lap("eval")
        self._ahead = ahead
        self._update(scheduled)
        outputs = [self._output(seq, token, None, failed.get(i))
                   for i, (seq, token) in enumerate(zip(sampling, sampled))]
        self.profile.end("output")
        return outputs

    def _burst_steps(self, scheduled: list[ScheduledSeq]) -> int:
        """How many decode steps to run as one (`_burst`), their slots allocated; 1: this step alone.

        Where the device computes as a step is launched (MLX on the CPU), the host's work on a step (scheduling,
        building it, taking its tokens) cannot hide behind the device's, and it runs with caches that the device's
        work has just emptied; a burst pays that once for several steps. Only plain greedy decodes burst (a sampled
        row draws on the host; a grammar masks each token by the one before; a draft is checked step by step), only
        while nobody waits to be admitted (who would wait for the whole burst), and only as far as every row's length
        limits allow."""
        be = self.backend
        if be.computes_async or not be.chains_steps or self.scheduler.waiting:
            return 1
        seqs = [item.seq for item in scheduled]
        if not all(item.samples and item.num_new_tokens == 1 and not item.draft for item in scheduled) or any(
                self.speculator.mode_for(seq) != "off" or self.constraints.constrained(seq.request_id)
                for seq in seqs):
            return 1
        steps = min(BURST, *(min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
                             for seq in seqs))
        if steps < 2 or not all(self.block_manager.allocate_slots(seq, steps) for seq in seqs):
            return 1  # what the slots took stays the sequences': their next steps need it
        return steps

    def _burst(self, scheduled: list[ScheduledSeq], steps: int) -> list[RequestOutput]:
        """`steps` decode steps of the same plain greedy rows (`_burst_steps`) launched as one, each step's tokens the
        samples of the step before, still on the device; then each sequence takes its tokens in order until it
        finishes (what it computed after a stop token or string goes with it)."""
        seqs = [item.seq for item in scheduled]
        self._prepare_pool()
        start = time.perf_counter()
        chain = [self.runner.sampled_tokens(scheduled, None, profile=self.profile)]
        for ahead in range(1, steps):
            items = [ScheduledSeq(seq, 1, ahead=ahead) for seq in seqs]
            chain.append(self.runner.sampled_tokens(items, None, device_tokens=chain[-1], profile=self.profile))
        tokens = self.backend.stack_tokens(chain)
        self.backend.launch(tokens)
        sampled = self.backend.fetch_tokens(tokens)
        self.profile.lap("eval")
        self.speculator.observe(len(seqs), (time.perf_counter() - start) / steps)
        st = self._stats
        st.steps += steps
        st.last_batch_seqs = st.last_batch_tokens = len(seqs)
        outputs = []
        for i, seq in enumerate(seqs):
            outs = []
            for row in sampled:
                seq.num_computed_tokens += 1
                self.block_manager.register_full_blocks(seq)
                outs.append(self._output(seq, row[i], None, None))
                if outs[-1].finished:
                    break
            outputs.append(merge_outputs(outs))
        self.profile.end("output", steps)
        return outputs

    def _allowed_tokens(self, seqs: list[Sequence], pending: Any) -> tuple[np.ndarray, dict[int, str]]:
        """The tokens each of seqs' rows may take as bits (SamplingRows.allowed: all of them where it has no grammar),
        from the masks pending computes; and the rows that fail, with why: their mask failed or allows nothing."""
        masks, failed = self.constraints.forbidden(pending, seqs)
        allowed = np.ones((len(seqs), self.vocab_size), bool)
        for row, mask in masks.items():
            allowed[row] = ~mask
            if not allowed[row].any():
                failed[row] = "no token is allowed"
        return np.packbits(allowed, axis=1, bitorder="little"), failed

    def _room_after_next(self, seq: Sequence) -> bool:
        """Whether seq, given the token now being sampled, may still take another."""
        return (seq.num_output_tokens + 1 < seq.params.max_tokens and seq.num_tokens + 1 < self.max_model_len)

    def _build_ahead(self, seqs: list[Sequence], tokens: Any) -> LaunchedAhead | None:
        """The decode of seqs one token on, from their tokens still on the device; None where the pool has no room
        for it (what it holds stays theirs: the next step needs it)."""
        if not all(self.block_manager.allocate_slots(seq, 2) for seq in seqs):
            return None
        self._move_tiers()  # blocks those slots took from the prefix cache: read before the step overwrites them
        items = [ScheduledSeq(seq, 1, ahead=1) for seq in seqs]
        generators = [(seq, seq.rng.bit_generator.state) for seq in seqs if not seq.params.greedy]
        ahead = self.runner.sampled_tokens(items, self._sampling_rows(seqs, recent=tokens), device_tokens=tokens,
                                           profile=self.profile)
        return LaunchedAhead(seqs, [item.first_position for item in items], ahead, generators)

    def run_to_completion(self, on_step: Callable[[list[RequestOutput]], None] | None = None
                          ) -> dict[str, Completion]:
        """Step until every request has finished; each request's outputs merged, by request id.

        on_step(outputs) runs after each step (it may add requests, which then run too).
        """
        results: dict[str, Completion] = {}
        while self.has_unfinished():
            outputs = self.step()
            for out in outputs:
                results.setdefault(out.request_id, Completion(out.request_id)).add(out)
            if on_step is not None:
                on_step(outputs)
        return results

    def _run(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        self._prepare_pool()
        return self.runner.run(scheduled, profile=self.profile)

    def _prepare_pool(self) -> None:
        """The prefix store's moves and the copy-on-write copies the step's blocks wait for."""
        self._move_tiers()
        copies = self.block_manager.take_pending_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def _move_tiers(self) -> None:
        """The K/V of blocks evicted since the last step into the prefix store, then the store's hits into the
        blocks given to them: every read before any write, and both before the step's copies and forward
        overwrite the pool."""
        bm = self.block_manager
        evicted = bm.take_evicted()
        if evicted:
            for (_, h, key), data in zip(evicted, self.runner.read_blocks([b for b, _, _ in evicted])):
                self.prefix_store.put(h, key, data)  # type: ignore[union-attr]
        loads = bm.take_pending_loads()
        if loads:
            self.runner.write_blocks(list(loads), [hit.data for hit in loads.values()])

    def _update(self, scheduled: list[ScheduledSeq]) -> None:
        """Count the step's tokens as computed (a draft's only once checked) and put newly full blocks into the
        prefix cache."""
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
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            self.block_manager.register_full_blocks(seq)

    @staticmethod
    def _logprobs(logits: np.ndarray, seqs: list[Sequence], tokens: list[int]) -> dict[int, dict]:
        """The logprobs entries of the rows (row i is seqs[i], which sampled tokens[i]) whose requests ask for them,
        by row: those rows at once."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return {}
        asked = logits if len(rows) == len(logits) else logits[rows]  # all of them: no copy
        entries = token_logprobs(asked, [tokens[i] for i in rows], [seqs[i].params.logprobs for i in rows])
        return dict(zip(rows, entries))

    def _output(self, seq: Sequence, token: int, logprob: dict | None, error: str | None) -> RequestOutput:
        """Append a sampled token; a finished request leaves the scheduler, and so does a failed one, alone."""
        if error is None:
            try:
                out = self._append(seq, token, logprob)
            except Exception as exc:  # detokenizing one request must not fail the batch
                error = f"output failed: {exc}"
        if error is not None:
            return self._fail(seq, error)
        if out.finished:
            self._retire(seq)
        return out

    def _check_draft(self, item: ScheduledSeq, rows: np.ndarray) -> RequestOutput:
        """Keep the longest run of item's draft that sampling accepts, then the token its first rejected (or its
        last) row gives; the K/V of rejected guesses is dropped with the blocks that held only them. A constrained
        request's row is masked by its grammar as it stands after the tokens accepted before it, so a guess the
        grammar forbids is rejected like any other."""
        seq, draft = item.seq, item.draft
        outs: list[RequestOutput] = []
        accepted = 0
        try:
            for i, row in enumerate(rows):
                guess = draft[i] if i < len(draft) else None
                failed = self.constraints.apply(row[None], self.constraints.start_masks([seq]), [seq])
                if failed:
                    return self._fail(seq, failed[0])
                q = item.draft_probs[i] if i < len(item.draft_probs) else None
                token = check_guess(row, seq, guess, q)
                outs.append(self._append(seq, token, self._logprobs(row[None], [seq], [token]).get(0)))
                if token != guess:
                    break
                accepted += 1
                if outs[-1].finished:
                    break
        except Exception as exc:  # one request's sampling or detokenizing must not fail the batch
            return self._fail(seq, f"output failed: {exc}")
        self.speculator.record(seq, len(draft), accepted, by_model=item.model_draft)
        out = merge_outputs(outs)
        if out.finished:
            self._retire(seq)
            return out
        # rows 1..accepted hold the K/V of the accepted guesses; the rest is never read (positions past the
        # sequence's computed tokens are written again before any row attends to them)
        seq.num_computed_tokens += accepted
        self.block_manager.register_full_blocks(seq)
        self.block_manager.trim(seq)
        if item.model_draft:  # and so the draft model's of the rejected guesses
            self.drafter.follow(seq)  # type: ignore[union-attr]
        return out

    def _append(self, seq: Sequence, token: int, logprob: dict | None) -> RequestOutput:
        seq.token_ids.append(token)
        grammar_complete = self.constraints.accept(seq, token)
        return self.output.process(seq, token, logprob, grammar_complete)

    def _retire(self, seq: Sequence) -> None:
        self.speculator.finished(seq)
        self.scheduler.finish(seq)
        self.constraints.drop(seq.request_id)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self._retire(seq)
        return self.output.fail(seq.request_id, error)

    def _count_outputs(self, num_tokens: int) -> None:
        self._stats.output_tokens += num_tokens
        now = time.perf_counter()
        self._recent.append((now, num_tokens))
        self._recent_tokens += num_tokens
        while now - self._recent[0][0] >= RATE_WINDOW:
            self._recent_tokens -= self._recent.popleft()[1]

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every position of token_ids [T, vocab], for scoring (perplexity, parity checks).

        Runs outside the scheduler, so call it only while no requests are in flight.
        """
        self.check_prompt(token_ids, scored_only=True)
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise PromptTooLongError(f"{len(token_ids)} tokens do not fit in the free KV blocks")
        try:
            self._move_tiers()
            return self.runner.run([ScheduledSeq(seq, len(token_ids))], all_rows=True)
        finally:
            self.block_manager.free_seq(seq)

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """Unit-length embeddings [len(prompts), hidden]: each prompt's final hidden states, normed, pooled over its
        tokens as the model says (mean by default, or its first or last token's), in one forward pass for all.

        Runs outside the scheduler, between steps (the engine thread's `AsyncEngine.call`).
        """
        for ids in prompts:
            self.check_prompt(ids, scored_only=True)
        seqs = [Sequence(f"embed-{i}", list(ids), SamplingParams(max_tokens=1)) for i, ids in enumerate(prompts)]
        held = []
        try:
            for seq in seqs:
                if not self.block_manager.allocate_slots(seq, seq.num_tokens):
                    raise PromptTooLongError(f"{sum(len(p) for p in prompts)} tokens to embed do not fit in the free "
                                             "KV blocks; send fewer inputs at once")
                held.append(seq)
            self._move_tiers()
            states = self.runner.run([ScheduledSeq(s, s.num_tokens) for s in seqs], all_rows=True, hidden=True)
        finally:
            for seq in held:
                self.block_manager.free_seq(seq)
        bounds = np.cumsum([0, *(len(ids) for ids in prompts)])
        pool = POOLING[self.model.pooling]
        pooled = np.stack([pool(states[a:b].astype(np.float64))
                           for a, b in zip(bounds[:-1], bounds[1:])])
        return (pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).astype(np.float32)

    def kv_map(self) -> list[tuple[str, list[str]]]:
        """Each pool block's state ('free', 'cached', 'used' or 'shared') and the requests holding it."""
        states = self.block_manager.block_states()
        owners: list[list[str]] = [[] for _ in states]
        for seq in self.scheduler.running:
            for b in seq.block_table:
                owners[b].append(seq.request_id)
        return list(zip(states, owners))

    # stats --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        st = self._stats
        usage = self.block_manager.usage()
        st.running = len(self.scheduler.running)
        st.waiting = len(self.scheduler.waiting)
        st.kv_blocks_total = usage.total
        st.kv_blocks_used = usage.used
        st.kv_blocks_cached = usage.cached
        st.kv_blocks_free = usage.free
        st.kv_tokens_stored = sum(seq.num_computed_tokens for seq in self.scheduler.running)
        st.prefix_hit_tokens = usage.prefix_hit_tokens
        st.prefix_query_tokens = usage.prefix_query_tokens
        st.prefix_ram_hit_tokens = self.block_manager.tier_hit_tokens["ram"]
        st.prefix_disk_hit_tokens = self.block_manager.tier_hit_tokens["disk"]
        if self.prefix_store is not None:
            store = self.prefix_store.usage()
            st.prefix_store_ram_bytes, st.prefix_store_disk_bytes = store.ram_bytes, store.disk_bytes
        st.preemptions = self.scheduler.num_preemptions
        st.draft_tokens, st.accepted_draft_tokens = self.speculator.drafted, self.speculator.accepted
        st.draft_checks = self.speculator.verify_steps
        if len(self._recent) > 1:  # the tokens after the window's first step, over the time since it
            span = self._recent[-1][0] - self._recent[0][0]
            st.tokens_per_second = (self._recent_tokens - self._recent[0][1]) / span if span > 0 else 0.0
        return EngineStats(**st.__dict__)


def _nbytes(obj: Any) -> int:
    """The bytes of the arrays in obj, however nested in lists, dicts and dataclasses (a model's layers)."""
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    if is_dataclass(obj):
        obj = vars(obj)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0
