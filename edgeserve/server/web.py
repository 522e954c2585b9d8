"""The web chat: a page at / and its files under /web/ (plain HTML, CSS and JavaScript shipped in the package, no
build step), which talk to the server through the public API only, as any client does."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

FILES = Path(__file__).with_name("web")
PAGE_PATH = "/"
ASSETS_PATH = "/web"
# The page loads nothing but its own files and calls nothing but this server: the policy holds it to that, so
# a Markdown answer cannot make the browser fetch from elsewhere either.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self'; object-src 'none'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def add_web_chat(app: FastAPI) -> None:
    """Serve the web chat's page at / and its files under /web/."""

    async def page() -> FileResponse:
        return FileResponse(FILES / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    app.add_api_route(PAGE_PATH, page, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PATH, StaticFiles(directory=FILES), name="web")
