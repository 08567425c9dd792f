"""The chat playground: `GET /` (to browsers) and its static files under `/ui/`, shipped in the package.

The page talks to this server's own `/v1/models` and `/v1/chat/completions` and fetches nothing from
anywhere else; a strict Content-Security-Policy (scripts, styles and connections from this origin only,
no inline code) keeps model output from ever running, as a second line behind the page building replies
as DOM nodes (markdown.js) and never parsing them as HTML. `POST /` stays TGI's
generate route; a `GET /` that does not accept HTML gets 406 with a pointer to both. `--no-ui` leaves
these routes out.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter(include_in_schema=False)

UI_PREFIX = "/ui/"
# name -> media type; nothing outside this list is ever served (no path from the URL reaches the disk)
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # small files, revalidated on each load so that an upgraded server never runs a stale page
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files("server.api").joinpath("static", name).read_bytes()


_CONTENT = {name: _read(name) for name in _FILES}


def is_page_request(method: str, path: str) -> bool:
    """Whether a request is for the page or its files, which stay open without the API key (the page
    itself asks for the key; every API call it makes carries it)."""
    return method in ("GET", "HEAD") and (path == "/" or path.startswith(UI_PREFIX))


def _file(name: str) -> Response:
    return Response(_CONTENT[name], media_type=_FILES[name], headers=_HEADERS)


@router.get("/")
async def page(request: Request) -> Response:
    if "text/html" in request.headers.get("accept", ""):
        return _file("index.html")
    return JSONResponse(
        {
            "error": "GET / serves the chat page to browsers (Accept: text/html); "
            "POST / generates (TGI), and /v1/chat/completions speaks OpenAI",
            "error_type": "not_acceptable",
        },
        status_code=406,
    )


@router.get(UI_PREFIX + "{name}")
async def static_file(name: str) -> Response:
    if name not in _FILES:
        return JSONResponse({"error": f"no such file: /ui/{name}", "error_type": "not_found"}, 404)
    return _file(name)
