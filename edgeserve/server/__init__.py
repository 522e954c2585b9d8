"""The HTTP server: `app` (create_app, admission), one package per API family (`openai`), edgeserve's own
routes (`status`), `middleware`, `errors`, `generation` (one API request as engine requests), `metrics`,
`shutdown`."""
