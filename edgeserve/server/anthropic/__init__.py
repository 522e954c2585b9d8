"""Anthropic's Messages API: a message and its token count (`routes`), their request bodies (`protocol`), and
engine deltas in its response shapes (`responses`)."""

from edgeserve.server.anthropic.routes import router

__all__ = ["router"]
