"""edgeserve's own routes, about the server rather than a model API: /health, /metrics (Prometheus, the loaded
engines added up) and /v1/edgeserve/kv (a KV pool's blocks, which `edgeserve tui --url` draws)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

if TYPE_CHECKING:
    from edgeserve.server.app import Server

KV_STATES = ("free", "cached", "used", "shared")


def router(server: Server) -> APIRouter:
    """The routes, on `server`'s loaded models."""
    models = server.models

    async def health() -> dict | JSONResponse:
        for entry in models.loaded:
            if not entry.model.aengine.alive:
                return JSONResponse({"status": "error", "model": entry.name, "error": entry.model.aengine.error},
                                    status_code=503)
        if server.draining:
            return JSONResponse({"status": "draining", "model": server.model_name, "running": len(server.live)},
                                status_code=503)
        stats = models.stats()
        return {"status": "ok", "model": server.model_name, "running": stats.running, "waiting": stats.waiting,
                "loaded": [e.name for e in models.loaded]}

    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(models.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv(model: str | None = None) -> dict:
        """The KV pool of the model named (loaded for it where it is not), else of the default model if loaded,
        else of the one used last; an empty pool while none is loaded."""
        if model is not None:
            aengine = (await server.model(model))[0].aengine
        elif loaded := models.loaded:
            entry = models.default if models.default in loaded else max(loaded, key=lambda e: e.last_used)
            aengine = entry.model.aengine
        else:
            return {"block_size": 0, "num_blocks": 0, "counts": dict.fromkeys(KV_STATES, 0), "blocks": []}
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
