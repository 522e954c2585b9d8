"""Engine deltas in OpenAI's shapes: the chunks of a streamed chat or text completion, or its one body, and the
Responses API's response object and its streamed events.

Everything a client of these endpoints reads is built here: the envelope, the deltas (tool calls streamed as
they are written), logprobs, usage, finish reasons, and the server-sent events.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from edgeserve.engine.output import RequestOutput
from edgeserve.server.errors import error_body
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.openai.protocol import json_or_text
from edgeserve.server.sse import sse, sse_response
from edgeserve.text.tokenizer import Tokenizer
from edgeserve.text.tool_calls import ToolCallFormat
from edgeserve.text.tool_stream import (
    AnswerEvents,
    CallArguments,
    CallEnded,
    CallStarted,
    Event,
    ReasoningText,
    Text,
)


def usage(gen: Generation) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def envelope(gen: Generation, object_: str, model: str, choices: list[dict], **extra: Any) -> dict:
    return {"id": gen.response_id, "object": object_, "created": gen.created, "model": model, "choices": choices,
            **extra}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events: the given ones, an error event if generation fails midway, then [DONE]."""
    return sse_response(events, lambda exc: sse(error_body(f"generation failed: {exc}", "server_error")), sse("[DONE]"))


def chat_logprobs(entries: list[dict], tokenizer: Tokenizer) -> dict:
    """The engine's per-token logprobs in the chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], tokenizer: Tokenizer, offset: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, logprobs, top alternatives, text offsets.

    `offset` is where the first token starts in the completion text.
    """
    tokens, offsets = [], []
    for e in entries:
        text = tokenizer.token_text(e["token"])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.token_text(t): lp for t, lp in e["top"]} for e in entries],
        "text_offset": offsets,
    }


class ChatResponse:
    """A chat completion (`chat.completion`, or `chat.completion.chunk`s when streamed).

    Each answer is read by the tool-call state machine (`text.tool_stream`): its text is `content`, a leading
    reasoning section `reasoning_content`, and its tool calls `tool_calls` (where the request offered tools,
    tool_format), streamed as OpenAI streams them: a call's id, type, name and empty arguments first, then its
    arguments in fragments as they are written. An answer that made calls ends with finish_reason "tool_calls".
    """

    def __init__(self, gen: Generation, model: str, tokenizer: Tokenizer, tool_format: ToolCallFormat | None,
                 reasoning: bool = True, in_reasoning: bool = False):
        self.gen, self.model, self.tokenizer = gen, model, tokenizer
        self._answers = {c.index: AnswerEvents(tool_format, reasoning, in_reasoning) for c in gen.choices}

    def finish_reason(self, c: Choice) -> str | None:
        return "tool_calls" if self._answers[c.index].calls and c.finish_reason == "stop" else c.finish_reason

    def _logprobs(self, c: Choice, entries: list[dict]) -> dict | None:
        return chat_logprobs(entries, self.tokenizer) if c.params.logprobs is not None else None

    def message(self, c: Choice) -> dict:
        """The whole answer as a chat message: content, reasoning, and tool calls where it made some."""
        answer = self._answers[c.index]
        answer.feed("".join(c.text))
        answer.finish(cut=c.finish_reason == "length")
        content = (answer.text.strip() or None) if answer.calls else answer.text
        message: dict = {"role": "assistant", "content": content}
        if answer.reasoning_text:
            message["reasoning_content"] = answer.reasoning_text
        if answer.calls:
            message["tool_calls"] = [call.openai(call_id) for call, call_id in zip(answer.calls, answer.call_ids)]
        return message

    def body(self) -> dict:
        choices = []
        for c in self.gen.choices:
            message = self.message(c)  # first: it reads the tool calls the finish reason depends on
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, c.logprobs),
                            "finish_reason": self.finish_reason(c)})
        return envelope(self.gen, "chat.completion", self.model, choices, usage=usage(self.gen))

    def deltas(self, c: Choice, out: RequestOutput) -> list[dict]:
        """The streamed deltas out settles, in order (the tool-call state machine's events as OpenAI's deltas)."""
        answer = self._answers[c.index]
        events = answer.feed(out.text) + (answer.finish(cut=out.finish_reason == "length") if out.finished else [])
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, Text):
                deltas.append({"content": event.text})
            elif isinstance(event, ReasoningText):
                deltas.append({"reasoning_content": event.text})
            elif isinstance(event, CallStarted):
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, CallArguments):
                last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
                if last is not None and last["index"] == event.index and "id" not in last:
                    last["function"]["arguments"] += event.fragment
                else:
                    deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]})
        return deltas

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The chunks as server-sent events: a role chunk per choice, the deltas, and the usage if asked for."""
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope(self.gen, "chat.completion.chunk", self.model, [choice], **extra))

        for c in self.gen.choices:
            yield chunk(c.index, {"role": "assistant", "content": ""})
        async for c, out in self.gen.outputs():
            logprobs = self._logprobs(c, out.logprobs) if c.params.logprobs is not None and out.logprobs else None
            deltas = self.deltas(c, out)
            if not deltas and (logprobs or out.finished):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield chunk(c.index, delta, logprobs if i == 0 else None,
                            self.finish_reason(c) if out.finished and last else None)
        if include_usage:
            yield sse(envelope(self.gen, "chat.completion.chunk", self.model, [], usage=usage(self.gen)))


class CompletionResponse:
    """A text completion (`text_completion`, as one body or as streamed chunks)."""

    def __init__(self, gen: Generation, model: str, tokenizer: Tokenizer):
        self.gen, self.model, self.tokenizer = gen, model, tokenizer

    def body(self) -> dict:
        choices = [{
            "index": c.index,
            "text": "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs, self.tokenizer, 0) if c.params.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        } for c in self.gen.choices]
        return envelope(self.gen, "text_completion", self.model, choices, usage=usage(self.gen))

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The chunks as server-sent events, and the usage if asked for."""
        extra = {"usage": None} if include_usage else {}
        offsets = dict.fromkeys((c.index for c in self.gen.choices), 0)  # where each text's next token starts
        async for c, out in self.gen.outputs():
            logprobs = None
            if c.params.logprobs is not None and out.logprobs:
                logprobs = completion_logprobs(out.logprobs, self.tokenizer, offsets[c.index])
                offsets[c.index] += sum(len(t) for t in logprobs["tokens"])
            if out.text or logprobs or out.finished:
                choice = {"index": c.index, "text": out.text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason if out.finished else None}
                yield sse(envelope(self.gen, "text_completion", self.model, [choice], **extra))
        if include_usage:
            yield sse(envelope(self.gen, "text_completion", self.model, [], usage=usage(self.gen)))


class ResponsesAnswer:
    """A Responses API response: its output items (reasoning, message, function_call), as one body or as the
    streamed events (response.created, response.in_progress, response.output_item.added, ….delta, ….done,
    response.output_item.done, response.completed or response.incomplete).

    echo: the request's settings the response object repeats. on_done(body, assistant message) is called once
    the response is whole (to store it).
    """

    def __init__(self, gen: Generation, model: str, tool_format: ToolCallFormat | None, in_reasoning: bool,
                 echo: dict[str, Any], on_done: Callable[[dict, dict], None] | None = None):
        self.gen, self.model, self.echo, self.on_done = gen, model, echo, on_done
        self.answer = AnswerEvents(tool_format, reasoning=True, in_reasoning=in_reasoning)
        self.items = _OutputItems()
        self._sequence = 0  # events streamed

    @property
    def choice(self) -> Choice:
        return self.gen.choices[0]

    def response(self, status: str) -> dict:
        """The response object as it stands (status "in_progress", "completed" or "incomplete")."""
        done = status != "in_progress"
        body = {"id": self.gen.response_id, "object": "response", "created_at": self.gen.created, "status": status,
                "model": self.model, "output": self.items.done if done else [], "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo}
        if done:
            body["usage"] = {"input_tokens": self.gen.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": self.gen.cached_tokens, "cache_write_tokens": 0},
                             "output_tokens": self.gen.completion_tokens,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": self.gen.prompt_tokens + self.gen.completion_tokens}
        return body

    def _status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def _finished(self) -> dict:
        body = self.response(self._status())
        if self.on_done is not None:
            message: dict[str, Any] = {"role": "assistant", "content": self.answer.text}
            if self.answer.calls:
                message["tool_calls"] = [{"id": i, "type": "function", "function": {
                    "name": c.name, "arguments": json_or_text(c.arguments)}}
                    for c, i in zip(self.answer.calls, self.answer.call_ids)]
            self.on_done(body, message)
        return body

    def body(self) -> dict:
        events = self.answer.feed("".join(self.choice.text)) + self.answer.finish(cut=self._status() == "incomplete")
        for event in events:
            self.items.render(event)
        self.items.close(cut=self._status() == "incomplete")
        return self._finished()

    def _event(self, payload: dict) -> str:
        """One streamed event, with the next sequence number."""
        self._sequence += 1
        return sse({**payload, "sequence_number": self._sequence - 1}, payload["type"])

    def stream(self) -> StreamingResponse:
        """The streamed events, with an error event if generation fails midway."""
        return sse_response(self.events(), lambda exc: self._event(
            {"type": "error", "code": "server_error", "message": f"generation failed: {exc}", "param": None}))

    async def events(self) -> AsyncIterator[str]:
        """The streamed events, each with its sequence number."""
        event = self._event

        yield event({"type": "response.created", "response": self.response("in_progress")})
        yield event({"type": "response.in_progress", "response": self.response("in_progress")})
        async for _, out in self.gen.outputs():
            events = self.answer.feed(out.text)
            if out.finished:
                events += self.answer.finish(cut=out.finish_reason == "length")
            for e in events:
                for payload in self.items.render(e):
                    yield event(payload)
        for payload in self.items.close(cut=self._status() == "incomplete"):
            yield event(payload)
        body = self._finished()
        yield event({"type": f"response.{body['status']}", "response": body})


class _OutputItems:
    """The answer's events as Responses output items: one open at a time, added, filled by deltas, and done."""

    def __init__(self) -> None:
        self.done: list[dict] = []  # the finished items
        self.item: dict | None = None  # the open one

    @property
    def index(self) -> int:
        return len(self.done)

    def close(self, cut: bool = False) -> list[dict]:
        """The open item's closing events; cut (at max_output_tokens) leaves it "incomplete", as OpenAI does."""
        item, self.item = self.item, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.index}
        payloads = []
        if item["type"] == "message":
            part = item["content"][0]
            payloads += [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                          "logprobs": []},
                         {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            payloads.append({"type": "response.reasoning_text.done", **where, "content_index": 0,
                             "text": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            payloads.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                             "arguments": item["arguments"]})
        if item["status"] == "in_progress":
            item["status"] = "incomplete" if cut else "completed"
        payloads.append({"type": "response.output_item.done", "output_index": self.index, "item": item})
        self.done.append(item)
        return payloads

    def _open(self, item: dict, added: dict) -> list[dict]:
        payloads = self.close()
        self.item = item
        return payloads + [{"type": "response.output_item.added", "output_index": self.index, "item": added}]

    def render(self, event: Event) -> list[dict]:
        """The stream's payloads for event (without sequence numbers)."""
        item = self.item
        if isinstance(event, Text):
            payloads = []
            if item is None or item["type"] != "message":
                new = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                       "content": []}
                payloads = self._open({**new, "content": [{"type": "output_text", "text": "", "annotations": [],
                                                           "logprobs": []}]}, new)
                payloads.append({"type": "response.content_part.added", "item_id": new["id"],
                                 "output_index": self.index, "content_index": 0,
                                 "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
            self.item["content"][0]["text"] += event.text
            return payloads + [{"type": "response.output_text.delta", "item_id": self.item["id"],
                                "output_index": self.index, "content_index": 0, "delta": event.text, "logprobs": []}]
        if isinstance(event, ReasoningText):
            payloads = []
            if item is None or item["type"] != "reasoning":
                new = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
                payloads = self._open({**new, "content": [{"type": "reasoning_text", "text": ""}]}, new)
            self.item["content"][0]["text"] += event.text
            return payloads + [{"type": "response.reasoning_text.delta", "item_id": self.item["id"],
                                "output_index": self.index, "content_index": 0, "delta": event.text}]
        if isinstance(event, CallStarted):
            new = {"id": _item_id("fc"), "type": "function_call", "call_id": event.id, "name": event.name,
                   "arguments": "", "status": "in_progress"}
            return self._open(new, dict(new))
        if isinstance(event, CallArguments):
            item["arguments"] += event.fragment
            return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                     "output_index": self.index, "delta": event.fragment}]
        if isinstance(event, CallEnded):
            if not event.complete:
                item["status"] = "incomplete"
            return self.close()
        return []


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
