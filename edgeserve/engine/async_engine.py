"""The one door into an engine: its step loop on a background thread, per-request deltas streamed to asyncio
consumers, and the prompt-side work, each safe to call from an event loop.

Every front end (server, chat, TUI, the offline LLM) holds an AsyncEngine and nothing behind it, so all
their sessions are batched together and none touches the engine thread's objects.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from edgeserve.engine.llm_engine import EngineInfo, EngineStats, LLMEngine
from edgeserve.engine.output import RequestOutput
from edgeserve.engine.prompts import Prompts
from edgeserve.engine.step_gate import STEP_GATE
from edgeserve.errors import EdgeserveError, GroupLostError
from edgeserve.sampling_params import SamplingParams
from edgeserve.text.tokenizer import Tokenizer
from edgeserve.text.tool_calls import ToolCallFormat

# A test hook for the fault tests: with this set to N, the engine thread raises after its Nth step,
# outside the step's own error handling, as a bug in the loop itself would.
FAULT_ENV = "EDGESERVE_TEST_ENGINE_FAULT"
# Seconds between the stats snapshots the engine thread takes while it steps: a snapshot walks the free KV blocks
# (a 1 GiB pool holds thousands), a fifth of a millisecond or more, which every step of a fast model paid.
STATS_EVERY = 0.05


class AsyncEngine:
    """`AsyncEngine(LLMEngine(...))` starts the engine thread; from then on the engine is reached only through here.

    Requests: `generate` (a stream of deltas), `abort`. State: `info` (fixed), `stats`, `kv_map`, `snapshot`.
    Prompt side: `chat_prompt`, `tokenize`, `check_prompt`, `compile_grammar`; `prompts` holds the same work
    as plain calls, for code that runs no event loop.
    """

    def __init__(self, engine: LLMEngine):
        self._engine = engine  # the engine thread's alone: reached from other threads only through the inbox
        self.info: EngineInfo = engine.info
        self.prompts = Prompts.for_engine(engine)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None  # why the engine thread died, if it did
        self._fault_after = int(os.environ.get(FAULT_ENV, "0"))
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="edgeserve-grammars")
        self._thread = threading.Thread(target=self._loop, name="edgeserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, read-only: for turning token ids of outputs into text (logprobs)."""
        return self.prompts.tokenizer

    @property
    def tool_format(self) -> ToolCallFormat:
        """How the model's answers call tools (their grammar, and how to parse them)."""
        return self.prompts.tool_format

    # the prompt side: worker threads, since a long prompt takes seconds to render or a grammar to compile

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                          add_generation_prompt: bool = True) -> list[int]:
        """The token ids of messages rendered through the model's chat template, offering tools."""
        return await asyncio.to_thread(self.prompts.chat, messages, tools, add_generation_prompt)

    async def tokenize(self, text: str, add_special: bool | None = None) -> list[int]:
        """A plain text prompt's token ids, with BOS where the model wants one (add_special None) or as told."""
        return await asyncio.to_thread(self.prompts.encode, text, add_special)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise PromptTooLongError where the prompt cannot run even alone, EdgeserveError where it is malformed.

        Arithmetic on fixed limits, so called directly.
        """
        self.prompts.check(prompt_ids)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Check params against the vocabulary and compile their grammar; InvalidParamsError where either fails."""
        if not params.constrained:  # nothing to compile: no thread needed
            self.prompts.compile_grammar(params)
        else:  # on a thread of their own: a flood of big grammars queues there, not before every chat's rendering
            await asyncio.get_running_loop().run_in_executor(self._compiler, self._compile_grammar, params)

    @staticmethod
    def between_steps() -> AbstractContextManager[None]:
        """Held through a long piece of work that holds the GIL (parsing a large body): it runs between two steps of
        every engine of this process, not beside one (engine/step_gate.py)."""
        return STEP_GATE.bulk()

    def _compile_grammar(self, params: SamplingParams) -> None:
        """On the grammar thread: a large schema made text between the engine's steps, then the grammar compiled."""
        if params.large_schema:
            with self.between_steps():
                params.write_schema()
        self.prompts.compile_grammar(params)

    # state --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread at most STATS_EVERY seconds ago while it steps, after its last
        step once it rests."""
        return self._stats

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running and can take requests."""
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> str | None:
        """Why the engine thread died, or None while it runs."""
        return None if self._error is None else f"engine thread died: {self._error!r}"

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine has shut down")

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._compiler.shutdown(wait=False, cancel_futures=True)

    def _deliver(self, out: RequestOutput | Exception, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            if not _post(loop, q.put_nowait, out):  # its consumer's event loop is gone: nobody reads on
                self._streams.pop(request_id, None)
                self._engine.abort(request_id)

    def _take_inbox(self) -> Iterator[tuple[str, Any]]:
        """The queued messages, oldest first, until the inbox is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for kind, payload in self._take_inbox():
            if kind == "add":
                request_id, prompt, params = payload
                try:
                    self._engine.add_request(prompt, params, request_id)
                except EdgeserveError as exc:
                    self._deliver(exc, request_id)
                except Exception as exc:  # a request that cannot start fails alone, never the engine thread
                    self._deliver(EdgeserveError(f"request failed to start: {exc!r}"), request_id)
            elif kind == "call":  # run fn on the engine thread, between steps
                fn, loop, future = payload
                try:
                    result = fn(self._engine)
                except Exception as exc:
                    _post(loop, _settle, (future, exc, None))
                else:
                    _post(loop, _settle, (future, None, result))
            elif kind == "abort":
                try:
                    final = self._engine.abort(payload)
                except Exception as exc:
                    self._deliver(EdgeserveError(f"abort failed: {exc!r}"), payload)
                else:
                    if final is not None:
                        self._deliver(final, payload)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # nothing left to run requests: fail every waiting caller now
            self._error = exc
            self._fail_all(EngineDeadError(self.error or repr(exc)))
            return
        finally:
            STEP_GATE.rest()
        self._engine.close()  # stopped: what its pool computed goes to the prefix store's disk tier

    def _fail_all(self, exc: Exception) -> None:
        """Fail every stream and pending call: after _error is set, nobody else will answer them."""
        for _, (loop, q) in list(self._streams.items()):
            _post(loop, q.put_nowait, exc)
        for kind, payload in self._take_inbox():
            if kind == "call":
                _, loop, future = payload
                _post(loop, _settle, (future, exc, None))

    def _run(self) -> None:
        steps = 0
        taken = time.perf_counter()  # when the stats were last taken
        while not self._stop.is_set():
            self._drain_inbox()
            if not self._engine.has_unfinished():
                STEP_GATE.rest()
                self._stats = self._engine.stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            with STEP_GATE.step():
                try:
                    outputs = self._engine.step()
                except GroupLostError:  # a split model lost a rank: no step can run again, so the engine dies
                    raise
                except Exception as exc:  # a broken step must not kill the server: fail the running requests
                    for rid in self._engine.request_ids():
                        self._engine.abort(rid)
                        self._deliver(EdgeserveError(f"engine step failed: {exc}"), rid)
                    outputs = []
                if any(out.finished for out in outputs):  # before the answers go out: who reads them, reads these
                    self._stats = self._engine.stats()
                    taken = time.perf_counter()
                for out in outputs:
                    self._deliver(out, out.request_id)
            if time.perf_counter() - taken >= STATS_EVERY:
                self._stats = self._engine.stats()
                taken = time.perf_counter()
            steps += 1
            if steps == self._fault_after:
                raise RuntimeError(f"injected engine fault after {steps} steps ({FAULT_ENV})")

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs as they come; leaving early (or cancelling) aborts it."""
        request_id = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self._check_alive()  # after registering: a thread dying from now on fails this stream too
            self._inbox.put(("add", (request_id, prompt, params or SamplingParams())))
            self._wake.set()
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    async def call(self, fn: Any) -> Any:
        """Run fn(engine) on the engine thread between steps (safe access to its state).

        For tools and tests that need more than this door shows; front ends use the methods here.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        self._wake.set()
        if not self.alive:  # after queueing: the dying thread fails whatever it finds queued
            self._fail_all(EngineDeadError(self.error or "the engine has shut down"))
        return await future

    async def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """Unit-length embeddings of the prompts (token ids), computed on the engine thread between steps."""
        return await self.call(lambda engine: engine.embed(prompts))

    async def kv_map(self) -> list[tuple[str, list[str]]]:
        """Each KV pool block's state ('free', 'cached', 'used' or 'shared') and the requests holding it."""
        return await self.call(lambda engine: engine.kv_map())

    async def snapshot(self) -> tuple[EngineStats, list[tuple[str, list[str]]]]:
        """The stats and the KV map read together between two steps, so that they agree."""
        return await self.call(lambda engine: (engine.stats(), engine.kv_map()))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()


class EngineDeadError(EdgeserveError):
    """The engine thread is gone, so no request can run."""


def _settle(outcome: tuple[asyncio.Future, BaseException | None, Any]) -> None:
    """Give a call's future its exception or result, on its loop, unless its caller cancelled it meanwhile."""
    future, exc, result = outcome
    if future.done():  # cancelled after the engine thread took the call: nobody waits for the answer
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, fn: Any, arg: Any) -> bool:
    """Run fn(arg) on loop's thread; False when that loop has closed (its caller gave up and left)."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # closed loop: the engine thread must outlive any one caller
        return False
    return True
