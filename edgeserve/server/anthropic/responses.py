"""Engine deltas in Anthropic's shapes: a message's content blocks (text, thinking, tool_use), as one body or as the
streamed events (message_start, content_block_start / delta / stop, message_delta, message_stop, ping)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from edgeserve.server.anthropic.protocol import tool_input
from edgeserve.server.errors import anthropic_error_body
from edgeserve.server.generation import Choice, Generation
from edgeserve.server.sse import sse, sse_response
from edgeserve.text.tool_calls import ToolCallFormat
from edgeserve.text.tool_stream import AnswerEvents, CallArguments, CallEnded, CallStarted, Event, ReasoningText, Text


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Anthropic's server-sent events, with an error event if generation fails midway."""
    return sse_response(events, lambda exc: sse(anthropic_error_body(500, f"generation failed: {exc}"), "error"))


def _event(payload: dict) -> str:
    return sse(payload, payload["type"])


class MessageResponse:
    """One message (Anthropic's API runs one answer per request).

    The answer is read by the tool-call state machine: a reasoning section becomes a thinking block, text a text
    block, each tool call a tool_use block whose input streams as input_json_delta fragments.
    """

    def __init__(self, gen: Generation, model: str, tool_format: ToolCallFormat | None, in_reasoning: bool):
        self.gen, self.model = gen, model
        self.answer = AnswerEvents(tool_format, reasoning=True, in_reasoning=in_reasoning)

    @property
    def choice(self) -> Choice:
        return self.gen.choices[0]

    def stop_reason(self) -> str | None:
        c = self.choice
        if c.finish_reason == "length":
            return "max_tokens"
        if c.stop_string is not None:
            return "stop_sequence"
        return "tool_use" if self.answer.calls else "end_turn" if c.finish_reason else None

    def usage(self) -> dict:
        return {"input_tokens": self.gen.prompt_tokens, "output_tokens": self.gen.completion_tokens,
                "cache_read_input_tokens": self.gen.cached_tokens}

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.gen.response_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason(), "stop_sequence": self.choice.stop_string,
                "usage": self.usage()}

    def body(self) -> dict:
        answer = self.answer
        answer.feed("".join(self.choice.text))
        answer.finish(cut=self.choice.finish_reason == "length")
        content: list[dict] = []
        if answer.reasoning_text:
            content.append({"type": "thinking", "thinking": answer.reasoning_text, "signature": ""})
        text = answer.text.strip() if answer.calls else answer.text
        if text:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": call_id, "name": call.name, "input": tool_input(call.arguments)}
                    for call, call_id in zip(answer.calls, answer.call_ids)]
        return self._message(content)

    async def events(self) -> AsyncIterator[str]:
        """The streamed events, in Anthropic's order."""
        start = self._message([])
        start["usage"]["output_tokens"] = 0
        yield _event({"type": "message_start", "message": start})
        yield _event({"type": "ping"})
        blocks = _Blocks()
        async for _, out in self.gen.outputs():
            events = self.answer.feed(out.text)
            if out.finished:
                events += self.answer.finish(cut=out.finish_reason == "length")
            for event in events:
                for payload in blocks.render(event):
                    yield _event(payload)
        for payload in blocks.close():
            yield _event(payload)
        yield _event({"type": "message_delta",
                      "delta": {"stop_reason": self.stop_reason(), "stop_sequence": self.choice.stop_string},
                      "usage": {"output_tokens": self.gen.completion_tokens}})
        yield _event({"type": "message_stop"})


class _Blocks:
    """The answer's events as content blocks: one open at a time, each started, filled by deltas, and stopped."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict) -> list[dict]:
        payloads = self.close()
        self.index += 1
        self.kind = block["type"]
        return payloads + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def render(self, event: Event) -> list[dict]:
        if isinstance(event, Text):
            payloads = self._open({"type": "text", "text": ""}) if self.kind != "text" else []
            return payloads + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ReasoningText):
            payloads = self._open({"type": "thinking", "thinking": "", "signature": ""}) \
                if self.kind != "thinking" else []
            return payloads + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, CallStarted):
            return self._open({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, CallArguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.fragment})]
        if isinstance(event, CallEnded):
            return self.close()
        return []
