"""OpenAI's API: chat and text completions (`routes`), their request bodies (`protocol`), and engine deltas in
their response shapes (`responses`)."""

from edgeserve.server.openai.routes import router

__all__ = ["router"]
