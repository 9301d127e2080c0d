"""The web playground: `GET /` (the page) and `GET /static/...` (its ES modules and stylesheet),
served from the package's own `static/` folder (API-server event loop; no build step, no CDN).

In: nothing but the path. Out: `index.html` with a Content-Security-Policy that lets the page load
only this server's own files and talk only to this server (images and media from `data:` / `blob:`
URLs it makes itself); the files under `static/` as they are. Neither needs the API key: the page
reads `GET /v1/capabilities` first, asks for the key when that answers 401, and sends it as
`Authorization: Bearer` on every `/v1` call. What the page shows follows the capabilities: chat
(streamed text; streamed audio played as it arrives), speech, image generation and edits with
per-step progress, video jobs.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")     # package data (pyproject: tool.setuptools.package-data)
CSP = ("default-src 'self'; img-src 'self' data: blob:; media-src 'self' data: blob:; connect-src 'self'; "
       "style-src 'self'; script-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def register_playground(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
