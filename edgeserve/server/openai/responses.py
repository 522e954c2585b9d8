"""Engine deltas in OpenAI's shapes: the chunks of a streamed chat or text completion, or its one body.

Everything a client of these endpoints reads is built here: the envelope, the deltas (tool calls streamed as
they are written), logprobs, usage, finish reasons, and the server-sent events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from edgeserve.engine.output import RequestOutput
from edgeserve.server.errors import error_body
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.sse import sse, sse_response
from edgeserve.text.tokenizer import Tokenizer
from edgeserve.text.tool_calls import ToolCallFormat
from edgeserve.text.tool_stream import AnswerEvents, CallArguments, CallStarted, ReasoningText, Text


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
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: list[dict], tokenizer: Tokenizer, offset: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, logprobs, top alternatives, text offsets.

    `offset` is where the first token starts in the completion text.
    """
    tokens, offsets = [], []
    for e in entries:
        text = tokenizer.decode([e["token"]])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top"]} for e in entries],
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
