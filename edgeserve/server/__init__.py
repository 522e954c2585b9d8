"""The HTTP server: `app` (create_app, admission), one package per API family (`openai`), edgeserve's own
routes (`status`), `middleware`, `errors`, `generation` (one API request as engine requests), `json_body`
(large request bodies parsed, and non-streamed answers made, off the event loop), `connections`, `metrics`, `shutdown`.

The limits the `serve` command offers as options are defined here, where its --help reads them without
importing the server (FastAPI, uvicorn).
"""

DEFAULT_MAX_QUEUE = 256  # requests waiting for the engine before new ones are refused
# bytes of one request body: parsing holds the GIL throughout (3.6 MB of empty messages stalled every stream
# ~200 ms), and 2 MiB is room for a 128k-token context
DEFAULT_MAX_BODY_SIZE = 2 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds running requests get to finish after a stop signal
