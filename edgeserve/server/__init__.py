"""The OpenAI-compatible HTTP server: app (routes), protocol (request/response bodies), generation, metrics.

The limits the `serve` command offers as options are defined here, where its --help reads them without
importing the server (FastAPI, uvicorn).
"""

DEFAULT_MAX_QUEUE = 256  # requests waiting for the engine before new ones are refused
DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024  # bytes of one request body
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds running requests get to finish after a stop signal
