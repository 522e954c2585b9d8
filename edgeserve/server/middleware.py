"""The server's ASGI middleware: which Host names and body sizes reach the app at all (HostGuard), and the
API key, the 503 while shutting down and the count of answers by status (Gate).

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap streaming responses and change
how client disconnects reach them.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgeserve.server.errors import APIError
from edgeserve.server.models import request_leases
from edgeserve.server.web import ASSETS_PATH, PAGE_PATH

if TYPE_CHECKING:
    from edgeserve.server.app import Server

# Loopback names a DNS-rebinding page cannot take over; IP literals are checked apart.
LOOPBACK_HOSTS = frozenset({"localhost"})


def host_name(host: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header names this server: loopback, an IP address, or an allowed name.

    DNS rebinding needs a name the attacker controls, so IP literals are safe; names must be known.
    """
    name = host_name(host)
    if "*" in allowed or not name or name in LOOPBACK_HOSTS or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """For every request: refuses unknown Host names (DNS rebinding), and bodies over the limit.

    The body is read here, counted, and replayed to the app, so a chunked body cannot dodge the limit.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str], max_body_size: int):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "")
        if not host_allowed(host, self.allowed_hosts):
            error = APIError(403, f"the Host {host_name(host)!r} is not allowed; start the server with "
                                  "--allowed-host NAME to accept it", code="host_not_allowed")
            await error.response(scope["path"])(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                first = message
                break
            size += len(message.get("body", b""))
            if size <= self.max_body_size:
                chunks.append(message.get("body", b""))
            # Over the limit the rest is drained, not kept: answering before the client has sent it
            # all would reset the connection under its feet. Past 16 times the limit it is cut off.
            if not message.get("more_body", False) or size > 16 * self.max_body_size:
                break
        if size > self.max_body_size:
            error = APIError(413, f"the request body is {size} bytes or more; the limit is {self.max_body_size} "
                                  "(--max-body-size)", code="request_too_large")
            await error.response(scope["path"])(scope, receive, send)
            return
        pending = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


# llama.cpp's routes outside /v1 and /api (Ollama's) that the API key guards too
KEYED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize"})
# answer without the key: /health, for load balancers' and supervisors' probes, and the web chat's page and
# files, which hold no data (the page asks for the key when the API answers 401)
OPEN_PATHS = frozenset({"/health", PAGE_PATH})
OPEN_PREFIX = ASSETS_PATH + "/"


class Gate:
    """For the APIs (/v1, Ollama's /api, /tokenize, /detokenize): the API-key check, 503 while shutting down, a count
    of answers by status code, and the end of the leases a request took on models. With a key set, every other
    path but /health and the web chat's needs it too."""

    def __init__(self, app: ASGIApp, server: Server, api_key: str | None):
        self.app = app
        self.server = server
        self.api_key = api_key

    @staticmethod
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(401, "missing or incorrect API key; send it as 'Authorization: Bearer KEY' or "
                              "'x-api-key: KEY'", code="invalid_api_key")
        await error.response(scope["path"])(scope, receive, send)

    def authorized(self, headers: Headers) -> bool:
        """Whether the request holds the key: as OpenAI's clients send it (Authorization: Bearer) or Anthropic's
        (x-api-key)."""
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return True
        return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        api = path.startswith(("/v1/", "/api/")) or path in KEYED_ROOT_PATHS
        open_path = path in OPEN_PATHS or path.startswith(OPEN_PREFIX)
        if scope["type"] != "http" or not (api or self.api_key is not None and not open_path):
            await self.app(scope, receive, send)
            return
        if not api:  # /metrics, /docs, /openapi.json: what the server runs is the key holder's business too
            if self.authorized(Headers(scope=scope)):
                await self.app(scope, receive, send)
            else:
                await self.refuse(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.server.metrics.http_requests[str(message["status"])] += 1
            await send(message)

        if not self.authorized(Headers(scope=scope)):
            await self.refuse(scope, receive, counting_send)
            return
        try:
            self.server.check_open()
        except APIError as closed:
            await closed.response(scope["path"])(scope, receive, counting_send)
            return
        leases: list = []
        token = request_leases.set(leases)
        self.server.open_requests += 1
        try:
            await self.app(scope, receive, counting_send)  # returns once the answer, stream and all, has gone out
        finally:
            self.server.open_requests -= 1
            request_leases.reset(token)
            for entry in leases:
                self.server.models.release(entry)
