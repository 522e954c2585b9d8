"""The OpenAI-compatible HTTP server: app (routes), protocol (request/response bodies), generation, metrics."""
