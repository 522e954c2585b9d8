"""Where the chat front ends send a conversation: the in-process engine, or a remote OpenAI-compatible server.

The terminal chat and the TUI talk to a ChatClient only, so neither cares which one it is. ("Backend"
is kept for the array backends, NumPy and MLX, that the engine computes with.)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, is_dataclass
from typing import TYPE_CHECKING, Any

from edgeserve.cli.conversation import Conversation
from edgeserve.errors import EdgeserveError
from edgeserve.sampling_params import SamplingParams
from edgeserve.units import format_size

if TYPE_CHECKING:
    from edgeserve.engine.async_engine import AsyncEngine

KV_STATES = ("free", "cached", "used", "shared")


@dataclass
class ReplyStats:
    """How one answer went; counts a server does not report are None."""

    prompt_tokens: int | None
    output_tokens: int
    cached_tokens: int | None
    ttft: float | None  # seconds from sending to the first token
    elapsed: float  # seconds from sending to the last token
    finish_reason: str | None

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: the tokens after the first over the time after the first."""
        if self.ttft is None or self.output_tokens < 2 or self.elapsed <= self.ttft:
            return 0.0
        return (self.output_tokens - 1) / (self.elapsed - self.ttft)

    def summary(self) -> str:
        parts = [f"{self.output_tokens} tokens"]
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft * 1000:.0f} ms")
        parts.append(f"{self.tokens_per_second:.1f} tokens/s")
        if self.prompt_tokens is not None:
            cached = f" ({self.cached_tokens} cached)" if self.cached_tokens is not None else ""
            parts.append(f"prompt {self.prompt_tokens}{cached}")
        return " · ".join(parts)

    def brief(self) -> str:
        """The summary short enough for a narrow session's border."""
        ttft = f" · TTFT {self.ttft * 1000:.0f} ms" if self.ttft is not None else ""
        return f"{self.output_tokens} tok · {self.tokens_per_second:.1f} tok/s{ttft}"


@dataclass
class ReplyChunk:
    text: str
    output_tokens: int  # generated so far
    stats: ReplyStats | None = None  # on the last chunk of an answer only


@dataclass
class KVBlock:
    state: str  # one of KV_STATES
    owners: list[str]  # request ids (the ones passed to stream()) holding the block


@dataclass
class ServingStatus:
    """A live picture of the engine behind a client; what a client cannot tell is None."""

    running: int | None = None
    waiting: int | None = None
    batch_size: int | None = None
    tokens_per_second: float | None = None
    memory_bytes: int | None = None
    prefix_hit_rate: float | None = None
    block_size: int | None = None
    kv_blocks: list[KVBlock] | None = None
    tier_hit_tokens: dict[str, int] | None = None  # prompt tokens loaded from the prefix store, by tier
    draft_checks: int | None = None  # decode steps of a request that checked a speculative draft
    draft_tokens: int | None = None  # tokens guessed and checked in them
    accepted_draft_tokens: int | None = None  # of those, the ones that were right

    def guesses(self) -> str | None:
        """How speculative decoding's guesses fare: the share that was right, and the tokens a request gained in a
        step that checked one (the right guesses and the checked token); None before a guess was checked."""
        if not self.draft_checks or not self.draft_tokens or self.accepted_draft_tokens is None:
            return None
        per_check = (self.accepted_draft_tokens + self.draft_checks) / self.draft_checks
        return f"{100 * self.accepted_draft_tokens / self.draft_tokens:.0f}% right, {per_check:.2f} tokens a check"


class ChatClient(ABC):
    model_name: str = ""
    runs_on: str = ""  # what computes the answers: the array backend's name, or the server's address
    context_tokens: int | None = None  # the most tokens one conversation may hold, where known

    async def start(self) -> None:
        """Connect (or whatever must happen inside the event loop) before the first stream."""

    async def aclose(self) -> None:
        """Release what start() opened."""

    def count_tokens(self, messages: list[dict]) -> int | None:
        """The prompt length of messages, where this client can tell."""
        return None

    def fit(self, conversation: Conversation, params: SamplingParams) -> int:
        """Trim the conversation's oldest turns to fit the context with room for an answer; return how many went."""
        if self.context_tokens is None:
            return 0
        room = min(params.max_tokens, self.context_tokens // 4)
        return conversation.trim(self.count_tokens, self.context_tokens - room)

    @abstractmethod
    def stream(self, messages: list[dict], params: SamplingParams, request_id: str) -> AsyncIterator[ReplyChunk]:
        """The answer to messages, piece by piece; leaving the loop early (or cancelling) stops the request."""

    @abstractmethod
    async def status(self) -> ServingStatus: ...


class EngineClient(ChatClient):
    """The in-process engine, through its door, shared by every session of a front end."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine
        info = aengine.info
        self.model_name = info.model_name
        self.runs_on = info.backend
        self.memory_bytes = info.memory_bytes
        # one sequence can hold no more than the model's context, nor more than the whole KV pool
        self.context_tokens = info.max_model_len

    def count_tokens(self, messages: list[dict]) -> int:
        # synchronous, as the chat front ends ask it: a conversation renders in milliseconds
        return len(self.aengine.prompts.chat(messages))

    async def stream(self, messages: list[dict], params: SamplingParams, request_id: str) -> AsyncIterator[ReplyChunk]:
        ids = await self.aengine.chat_prompt(messages)
        async for out in self.aengine.generate(ids, params, request_id):
            if out.error:
                raise EdgeserveError(out.error)
            stats = None
            if out.finished:
                stats = ReplyStats(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens,
                                   out.ttft, out.elapsed, out.finish_reason)
            yield ReplyChunk(out.text, out.num_output_tokens, stats)

    async def status(self) -> ServingStatus:
        # both read between two steps, so the figures and the map agree
        st, kv = await self.aengine.snapshot()
        blocks = [KVBlock(state, owners) for state, owners in kv]
        return ServingStatus(
            running=st.running, waiting=st.waiting, batch_size=st.last_batch_seqs if st.running else 0,
            tokens_per_second=st.tokens_per_second if st.running else 0.0, memory_bytes=self.memory_bytes,
            prefix_hit_rate=st.prefix_hit_rate,
            block_size=self.aengine.info.block_size, kv_blocks=blocks,
            tier_hit_tokens={"ram": st.prefix_ram_hit_tokens, "disk": st.prefix_disk_hit_tokens},
            draft_checks=st.draft_checks, draft_tokens=st.draft_tokens, accepted_draft_tokens=st.accepted_draft_tokens)


class RemoteClient(ChatClient):
    """A running `edgeserve serve`, or any OpenAI-compatible server, through the openai client.

    The KV map comes from the edgeserve-only `GET /v1/edgeserve/kv`, the engine figures from its
    `GET /metrics`; other servers have neither, so running streams and tokens/s are then counted on
    this side, over this client's own requests.
    """

    KV_PATH = "/v1/edgeserve/kv"
    METRICS_PATH = "/metrics"

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.model_name = model or ""
        self.runs_on = f"server {self.url}"
        self.client: Any = None
        self._http: Any = None
        self._missing: set[str] = set()  # paths the server answered 404 (or alike)
        self._active: set[str] = set()  # our request ids now streaming
        self._server_ids: dict[str, str] = {}  # the server's completion id -> our request id
        self._token_times: deque[float] = deque(maxlen=4096)

    async def start(self) -> None:
        try:
            import httpx
            import openai
        except ImportError:
            raise EdgeserveError("talking to a server needs the openai package: pip install openai") from None

        self.client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=5.0)
        try:
            models = [m.id async for m in self.client.models.list()]
        except openai.APIError as exc:
            await self.aclose()
            raise EdgeserveError(f"cannot list the models of {self.url}: {exc}") from None
        if not models or (self.model_name and self.model_name not in models):
            await self.aclose()
            raise EdgeserveError(f"{self.url} does not serve {self.model_name or 'any model'} "
                                 f"(it serves: {', '.join(models) or 'nothing'})")
        self.model_name = self.model_name or models[0]

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.close()
            await self._http.aclose()
            self.client = self._http = None

    async def stream(self, messages: list[dict], params: SamplingParams, request_id: str) -> AsyncIterator[ReplyChunk]:
        import openai

        defaults = SamplingParams()
        extra = {k: getattr(params, k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos")
                 if getattr(params, k) != getattr(defaults, k)}
        start = time.perf_counter()
        ttft, count, finish, usage, server_id = None, 0, None, None, None
        self._active.add(request_id)
        try:
            stream = await self.client.chat.completions.create(
                model=self.model_name, messages=messages, stream=True, max_tokens=params.max_tokens,
                temperature=params.temperature, top_p=params.top_p,
                seed=openai.NOT_GIVEN if params.seed is None else params.seed,
                stream_options={"include_usage": True}, extra_body=extra or None)
            try:
                async for chunk in stream:
                    if server_id is None and chunk.id:
                        server_id = chunk.id
                        self._server_ids[server_id] = request_id
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                        delta = choice.delta.content if choice.delta else None
                        if delta:
                            now = time.perf_counter()
                            ttft = ttft if ttft is not None else now - start
                            count += 1
                            self._token_times.append(now)
                            yield ReplyChunk(delta, count)
            finally:
                await stream.close()
                self._server_ids.pop(server_id, None)
        except openai.APIError as exc:
            raise EdgeserveError(f"{self.url}: {exc}") from None
        finally:
            self._active.discard(request_id)
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        yield ReplyChunk("", count, ReplyStats(
            prompt_tokens=usage.prompt_tokens if usage else None,
            output_tokens=usage.completion_tokens if usage else count,
            cached_tokens=getattr(details, "cached_tokens", None),
            ttft=ttft, elapsed=time.perf_counter() - start, finish_reason=finish))

    def _client_tokens_per_second(self, window: float = 5.0) -> float:
        now = time.perf_counter()
        recent = [t for t in self._token_times if now - t < window]
        return (len(recent) - 1) / (recent[-1] - recent[0]) if len(recent) > 1 and recent[-1] > recent[0] else 0.0

    def _our_id(self, owner: str) -> str:
        """Our request id for a server-side owner (the completion id, or one choice of it: 'id-0')."""
        for server_id, request_id in self._server_ids.items():
            if owner == server_id or owner.startswith(server_id + "-"):
                return request_id
        return owner

    async def _get(self, path: str) -> Any:
        """The response to GET path, or None where the server does not answer it (it is not edgeserve)."""
        import httpx

        if path in self._missing:
            return None
        try:
            response = await self._http.get(path)
        except httpx.HTTPError:
            return None
        if response.status_code in (404, 405, 501):
            self._missing.add(path)
        return response if response.status_code == 200 else None

    async def _kv_map(self) -> tuple[int, list[KVBlock]] | None:
        response = await self._get(self.KV_PATH)
        if response is None:
            return None
        try:
            data = response.json()
            blocks = [KVBlock(b["state"] if b["state"] in KV_STATES else "used", [self._our_id(o) for o in b["owners"]])
                      for b in data["blocks"]]
            return int(data["block_size"]), blocks
        except (ValueError, KeyError, TypeError):
            return None

    async def _metrics(self) -> dict[str, float]:
        """The samples of the server's Prometheus /metrics, where it has one, by name (with its labels, if any:
        'name{tier="ram"}')."""
        response = await self._get(self.METRICS_PATH)
        samples = {}
        for line in response.text.splitlines() if response is not None else []:
            name, _, value = line.partition(" ")
            if name and not name.startswith("#"):
                try:
                    samples[name] = float(value)
                except ValueError:
                    continue
        return samples

    async def status(self) -> ServingStatus:
        kv = await self._kv_map()
        metrics = await self._metrics()
        running = metrics.get("edgeserve_requests_running")
        waiting = metrics.get("edgeserve_requests_waiting")
        tiers = {t: metrics.get(f'edgeserve_prefix_cache_tier_hit_tokens_total{{tier="{t}"}}') for t in ("ram", "disk")}
        guesses = {r: metrics.get(f'edgeserve_speculative_draft_tokens_total{{result="{r}"}}')
                   for r in ("accepted", "rejected")}
        checks = metrics.get("edgeserve_speculative_checks_total")
        spoke_of_drafts = checks is not None and None not in guesses.values()
        return ServingStatus(
            running=len(self._active) if running is None else int(running),
            waiting=None if waiting is None else int(waiting),
            tokens_per_second=metrics.get("edgeserve_generation_tokens_per_second", self._client_tokens_per_second()),
            block_size=kv[0] if kv else None, kv_blocks=kv[1] if kv else None,
            tier_hit_tokens=None if None in tiers.values() else {t: int(n) for t, n in tiers.items()},
            draft_checks=int(checks) if spoke_of_drafts else None,
            draft_tokens=int(sum(guesses.values())) if spoke_of_drafts else None,
            accepted_draft_tokens=int(guesses["accepted"]) if spoke_of_drafts else None)


async def stats_report(client: ChatClient, conversation: Conversation, last: ReplyStats | None) -> list[str]:
    """The lines /stats shows: the conversation, its settings, the engine behind the client, the last answer."""
    size = f"{len(conversation.turns)} messages"
    if conversation.messages() and (tokens := client.count_tokens(conversation.messages())) is not None:
        size += f", {tokens} of {client.context_tokens} context tokens"
    lines = [f"conversation: {size}; system prompt: {conversation.system or '(the model default)'}"]
    params = conversation.sampling_params()
    lines.append(f"settings: temperature={params.temperature}, top_p={params.top_p}, "
                 f"max_tokens={params.max_tokens} (/set changes them)")
    st = await client.status()
    if st.kv_blocks is not None:
        counts = {s: sum(b.state == s for b in st.kv_blocks) for s in ("used", "shared", "cached", "free")}
        lines.append(f"KV pool: {len(st.kv_blocks)} blocks of {st.block_size} tokens: "
                     + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if st.prefix_hit_rate is not None:
        lines.append(f"prefix cache hit rate: {100 * st.prefix_hit_rate:.0f}%")
    if (guesses := st.guesses()) is not None:
        lines.append(f"speculative guesses: {guesses}")
    if st.memory_bytes is not None:
        lines.append(f"memory: {format_size(st.memory_bytes)} (weights and KV pool)")
    if last is not None:
        lines.append(f"last answer: {last.summary()}")
    return lines
