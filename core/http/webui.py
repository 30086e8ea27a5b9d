"""The built-in web chat page at ``/``: llama-server's web UI, Mixdesk's own page.

llama-server answers ``/`` with a chat page, and users who open the server's address
in a browser expect one. Ours is one self-contained file,
``resources/webui/index.html`` (inline CSS and JS, no external fetches), plus what a
browser asks for around it: the web app manifest, a service worker (offline start),
the icon, and ``/_app/version.json`` (the path llama.cpp's own UI and tests use),
generated from the build string ``/props`` reports.

Replies are shown as Markdown, rendered here by the one Markdown home of Mixdesk
(core/markdown.py: markdown-it-py with raw HTML off, pygments for code): the page
POSTs a reply's text to ``/mixdesk/markdown`` while it streams and gets the HTML back;
the pygments classes' stylesheet is put into the page's ``<style>`` when it is read
(the ``/* mixdesk:code-style */`` mark), so the page still fetches nothing else.

Everything else here is static: ``security.py`` lets :data:`PATHS` through without the
API key (the page asks for the key itself when an API call answers 401), while the
Host and Origin checks apply as to every other path. The Markdown route is not
static: it needs the key like any API route. ``--no-webui`` / ``--no-ui``
leave the routes out, so they answer 404 like any unknown path.

The files are read once, when the routes are added: a request never touches the
disk, and a file missing from a broken install is logged at startup and answered
with a 500 naming it, instead of failing the server.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from ..errors import HttpError
from ..markdown import web_css
from ..paths import resources_dir
from .build_info import build_info

log = logging.getLogger("mixdesk.http")

# The page may run its own inline script and style and talk to this server only:
# no third-party script, image or connection can be injected into it, and no other
# site may frame it (a framed chat box invites clickjacking).
PAGE_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
NO_CACHE = "no-cache"  # the browser may keep a copy but revalidates it (ETag) every time
VERSION_PATH = "/_app/version.json"
MARKDOWN_PATH = "/mixdesk/markdown"  # POST {"text"} -> {"html"}: a reply as the page shows it
MARKDOWN_MAX_CHARS = 1_000_000  # far above any reply (max_tokens); refuses a flood
MARKDOWN_INLINE_CHARS = 8192  # longer texts render on a worker thread, off the loop
CODE_STYLE_MARK = b"/* mixdesk:code-style */"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Asset:
    path: str  # the URL path
    file: str  # relative to the resources folder
    content_type: str
    cache_control: str
    page: bool = False  # the HTML page: gets the Content-Security-Policy


ASSETS = (
    Asset("/", "webui/index.html", "text/html", NO_CACHE, page=True),
    Asset("/sw.js", "webui/sw.js", "application/javascript", NO_CACHE),
    Asset(
        "/manifest.webmanifest", "webui/manifest.webmanifest", "application/manifest+json", NO_CACHE
    ),
    Asset("/icon-256.png", "icons/mixdesk-256.png", "image/png", "max-age=86400"),
)
# every static path of the web UI: security.py exempts exactly these from the API key
PATHS = frozenset({a.path for a in ASSETS} | {VERSION_PATH})
TEXT_TYPES = ("text/", "application/javascript", "application/manifest+json", "application/json")


def add_webui_routes(router: web.UrlDispatcher, resources: Path | None = None) -> None:
    """GET (and aiohttp's HEAD) routes for the page, its assets and version.json, and
    the page's Markdown route."""
    root = resources if resources is not None else resources_dir()
    for asset in ASSETS:
        router.add_get(asset.path, _asset_handler(asset, root / asset.file))
    version = json.dumps({"version": build_info()}).encode("utf-8")
    router.add_get(VERSION_PATH, _bytes_handler(version, "application/json", NO_CACHE, False))


def _asset_handler(asset: Asset, file: Path) -> Handler:
    try:
        body = file.read_bytes()
    except OSError as e:
        log.warning(
            "web UI: cannot read %s (%s); %s answers 500 (reinstall, or start with --no-webui)",
            file,
            type(e).__name__,
            asset.path,
        )
        return _missing_handler(asset)
    if asset.page:
        body = body.replace(CODE_STYLE_MARK, web_css().encode("utf-8"))
    return _bytes_handler(body, asset.content_type, asset.cache_control, asset.page)


def _missing_handler(asset: Asset) -> Handler:
    async def missing(request: web.Request) -> web.StreamResponse:
        # the server's own file paths stay in its log: this path needs no key
        raise HttpError(
            f"the web UI file {asset.file} cannot be read: it is missing or unreadable in "
            "this installation (see the server log; --no-webui turns the page off)",
            500,
            "server_error",
        )

    return missing


def _bytes_handler(body: bytes, content_type: str, cache_control: str, page: bool) -> Handler:
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    headers = {
        "Cache-Control": cache_control,
        "ETag": etag,
        "X-Content-Type-Options": "nosniff",
    }
    if page:
        headers["Content-Security-Policy"] = PAGE_CSP
        headers["Referrer-Policy"] = "no-referrer"
    charset = "utf-8" if content_type.startswith(TEXT_TYPES) else None

    async def serve(request: web.Request) -> web.StreamResponse:
        tags = _etags(request.headers.get("If-None-Match", ""))
        if etag in tags or "*" in tags:
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, content_type=content_type, charset=charset, headers=headers)

    return serve


def _etags(header: str) -> set[str]:
    """The entity tags of an If-None-Match header (``W/`` prefixes dropped: a weak
    match is enough for GET); ``*`` matches any."""
    return {t.strip().removeprefix("W/") for t in header.split(",") if t.strip()}
