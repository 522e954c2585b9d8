"""One API request on the engine: its choices run as engine requests at once, merged into one stream."""

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
from edgeserve.server.protocol import APIError, usage
from edgeserve.text.tool_calls import ToolCallStream, split_reply


@dataclass
class Choice:
    """One engine request, behind one choice of a response, and what it has produced so far."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    logprob_offset: int = 0  # where the next token starts in the text, for completions' text_offset
    finish_reason: str | None = None  # None until it ends; still None if it was cancelled
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    elapsed: float = 0.0
    tool_stream: ToolCallStream | None = None  # where the answer may hold tool calls (chat with tools)
    tool_calls: int = 0  # how many the answer holds

    def update(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs)
        self.completion_tokens = out.num_output_tokens
        self.cached_tokens = out.num_cached_tokens
        self.ttft = out.ttft
        self.elapsed = out.elapsed
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def chat_finish_reason(self) -> str | None:
        """OpenAI's reason: "tool_calls" where the answer ended after calling tools."""
        return "tool_calls" if self.tool_calls and self.finish_reason == "stop" else self.finish_reason

    def message(self) -> dict:
        """The whole answer as a chat message: content, and tool calls where it made some."""
        text = "".join(self.text)
        if self.tool_stream is None:
            return {"role": "assistant", "content": text}
        content, calls = split_reply(text, self.tool_stream.fmt)
        self.tool_calls = len(calls)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message

    def chat_delta(self, out: RequestOutput) -> dict:
        """The streamed chat delta for out: its content, and each tool call whole once its text is complete."""
        if self.tool_stream is None:
            return {"content": out.text} if out.text else {}
        content, calls = self.tool_stream.feed(out.text, out.finished)
        delta: dict = {"content": content} if content else {}
        if calls:
            first = self.tool_calls
            delta["tool_calls"] = [call.openai(index=first + i) for i, call in enumerate(calls)]
            self.tool_calls += len(calls)
        return delta


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

    def usage(self) -> dict:
        # A prompt counts once however many choices share it, and so do its cached tokens.
        cached = sum(c.cached_tokens for c in self.choices if c.index % self.n == 0)
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices), cached)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
