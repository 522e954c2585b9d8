"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) on the same engine."""

from edgeserve.server.ollama.routes import router

__all__ = ["router"]
