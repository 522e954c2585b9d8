"""edgeserve's own routes, about the server rather than a model API: /health, /metrics (Prometheus) and
/v1/edgeserve/kv (the KV pool's blocks, which `edgeserve tui --url` draws)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

if TYPE_CHECKING:
    from edgeserve.server.app import Server

KV_STATES = ("free", "cached", "used", "shared")


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s engine."""
    aengine = server.aengine

    async def health() -> dict | JSONResponse:
        if not aengine.alive:
            return JSONResponse({"status": "error", "model": server.model_name, "error": aengine.error},
                                status_code=503)
        if server.draining:
            return JSONResponse({"status": "draining", "model": server.model_name, "running": len(server.live)},
                                status_code=503)
        stats = aengine.stats()
        return {"status": "ok", "model": server.model_name, "running": stats.running, "waiting": stats.waiting}

    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(aengine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv() -> dict:
        blocks = await aengine.kv_map()
        counts = Counter(state for state, _ in blocks)
        return {
            "block_size": aengine.info.block_size,
            "num_blocks": len(blocks),
            "counts": {s: counts.get(s, 0) for s in KV_STATES},
            "blocks": [{"state": state, "owners": owners} for state, owners in blocks],
        }

    routes = APIRouter()
    routes.add_api_route("/health", health, methods=["GET"], response_model=None)
    routes.add_api_route("/metrics", metrics, methods=["GET"], response_model=None)
    routes.add_api_route("/v1/edgeserve/kv", kv, methods=["GET"], response_model=None)
    return routes
