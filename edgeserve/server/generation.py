"""One API request on the engine, whatever its API: its choices run as engine requests at once, merged into one
stream of engine deltas (the API's module shapes them into its chunks and bodies)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.engine.output import RequestOutput
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingParams
from edgeserve.server.errors import APIError


@dataclass
class Choice:
    """One engine request, behind one choice of a response, and what it has produced so far."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None  # None until it ends; still None if it was cancelled
    stop_string: str | None = None  # the stop string that ended it, where one did
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefix_diverged_at: int | None = None
    tier_cached_tokens: dict[str, int] = field(default_factory=dict)
    ttft: float | None = None
    elapsed: float = 0.0

    def update(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs)
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        self.prefix_diverged_at = out.prefix_diverged_at
        self.tier_cached_tokens = out.tier_cached_tokens
        self.ttft = out.ttft
        self.elapsed = out.elapsed
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_string = out.stop_string


class Generation:
    """The choices of one API request, running on the engine from the moment this is built.

    Streaming handlers read `outputs()`, the others `wait()`. When the last choice has ended
    (finished, failed or cancelled) `on_done(self)` is called once.
    """

    def __init__(self, aengine: AsyncEngine, response_id: str, choices: list[Choice], n: int, prompt_tokens: int,
                 stream: bool, on_done: Callable[[Generation], None]):
        self.aengine = aengine
        self.response_id = response_id
        self.created = int(time.time())
        self.choices = choices
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.error: Exception | None = None
        self._on_done = on_done
        self._queue: asyncio.Queue[tuple[Choice, RequestOutput | Exception]] = asyncio.Queue()
        self._pending = len(choices)
        self._tasks = [asyncio.create_task(self._pump(c)) for c in choices]
        # A done callback, unlike a finally block, also runs for a task cancelled before it started.
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    async def _pump(self, choice: Choice) -> None:
        try:
            async for out in self.aengine.generate(choice.prompt_ids, choice.params, choice.request_id):
                if out.error:
                    raise EdgeserveError(out.error)
                choice.update(out)
                if self.stream:
                    self._queue.put_nowait((choice, out))
        except Exception as exc:
            choice.finish_reason = "error"
            self.error = self.error or exc
            if self.stream:
                self._queue.put_nowait((choice, exc))

    def _task_done(self, _: asyncio.Task) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._on_done(self)

    def cancel(self) -> None:
        """Abort every choice still running (their KV blocks are freed at once)."""
        for task in self._tasks:
            task.cancel()

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each choice's outputs as they come, until all have finished; raises the first error."""
        try:
            remaining = len(self.choices)
            while remaining:
                choice, item = await self._queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                yield choice, item
        finally:
            self.cancel()

    async def wait(self, request: Request) -> None:
        """Wait for every choice to finish; a client that hangs up meanwhile cancels them."""
        everything = asyncio.gather(*self._tasks, return_exceptions=True)
        hangup = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({everything, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            self.cancel()
        if self.error is not None:
            raise APIError(500, f"generation failed: {self.error}", "server_error")

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache: a prompt counts once however many choices share it."""
        return sum(c.cached_tokens for c in self.choices if c.index % self.n == 0)

    @property
    def tier_cached_tokens(self) -> dict[str, int]:
        """Of cached_tokens, those loaded from each tier of the prefix store ("ram", "disk")."""
        total: dict[str, int] = {}
        for c in self.choices:
            if c.index % self.n == 0:
                for tier, n in c.tier_cached_tokens.items():
                    total[tier] = total.get(tier, 0) + n
        return total

    @property
    def prefix_diverged_at(self) -> int | None:
        """Where the (first) prompt left the longest prefix in the cache; None if it never did."""
        return self.choices[0].prefix_diverged_at if self.choices else None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
