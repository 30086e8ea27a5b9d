"""aiohttp middlewares: the request log, JSON errors, and the browser-facing defences.

A local inference server is attacked through the user's browser: any web page
can send requests to ``http://127.0.0.1:8080``. The defences, outermost first:

* Host check (403): only ``localhost``, loopback addresses and the configured
  host are accepted, which defeats DNS rebinding (the attacker's page reaches
  us under the attacker's domain name, so the Host header names that domain).
* Origin check (403): a request carrying an ``Origin`` header must come from a
  ``--cors-origins`` origin or from this server itself. Browsers send Origin on
  every cross-site POST, so a page cannot trigger generations or change the
  mix with a "simple" (preflight-less) request either.
* CORS: no CORS headers at all unless ``--cors-origins`` lists origins; then
  only listed origins are echoed back. ``localhost`` in the list means any
  loopback origin on any port (``http://127.0.0.1:3000``, ``http://[::1]``, ...),
  llama-server's meaning. A preflight OPTIONS is answered 200 either way, with
  CORS headers only for a listed origin (llama-server's form: a preflight without
  ``Access-Control-Allow-Origin`` is the browser's "no"; the request log says why).
* Body size (413) before anything reads the body; the app's client_max_size
  enforces the same limit for chunked bodies.
* API key (401) with ``hmac.compare_digest`` on every endpoint but /health and,
  when the web UI is on, its static files (:func:`public_paths`). A key that is not
  UTF-8 or holds a control character is a 401 like any wrong key. The key is never
  logged nor echoed, not even in the answer to a header aiohttp cannot parse
  (:func:`malformed_request`).

Runtime adapter loading opens a path the client names, so it is off unless the
server was started with ``--allow-runtime-lora``, and then only paths inside the
adapter folders (``--lora-dir``) are opened (:func:`adapter_path`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import HttpError, UserError
from .responses import error_body
from .webui import PATHS as WEBUI_PATHS

log = logging.getLogger("mixdesk.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DISCONNECTED = web.RequestKey("disconnected", bool)
LOG_NOTE = web.RequestKey("log_note", str)  # why, appended to the request's log line
CORS_ORIGIN = web.RequestKey("cors_origin", str)
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux; longer paths fail in open() anyway
LOGGED_PATH_CHARS = 300


def printable(text: str, limit: int = LOGGED_PATH_CHARS) -> str:
    """``text`` safe for one log line: control and other unprintable characters are
    escaped (a ``%0a`` in a URL must not start a forged line), long text is cut."""
    if len(text) > limit:
        text = text[:limit] + f"...({len(text)} chars)"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---- runtime adapter loading -----------------------------------------------------------


def runtime_lora_off() -> HttpError:
    return HttpError(
        "loading adapters over HTTP is off; start the server with --allow-runtime-lora "
        "(and --lora-dir DIR for the folders it may load from)",
        403,
        "permission_error",
    )


def default_lora_dirs(adapter_paths: Iterable[str | Path], user_dir: Path) -> list[Path]:
    """With --allow-runtime-lora but no --lora-dir: the folders of the adapters given
    on the command line, plus the user's own adapters folder."""
    out: list[Path] = []
    for p in [*(Path(a).parent for a in adapter_paths), user_dir]:
        if p not in out:
            out.append(p)
    return out


def adapter_path(path: str, dirs: Iterable[Path]) -> Path:
    """The file (or PEFT folder) a client asked to load, if it lies inside one of the
    adapter folders; else HttpError. Nothing is opened here: a path outside the
    folders is refused before the file system is asked anything about it (beyond
    resolving symlinks), so a client cannot probe for files elsewhere. A relative
    path is looked up in each folder in turn."""
    roots = [_resolved(Path(d)) for d in dirs]
    if not roots:
        raise HttpError("no adapter folder is configured (--lora-dir)", 403, "permission_error")
    if not path:
        raise HttpError("path must not be empty")
    if len(path) > MAX_PATH_CHARS:
        raise HttpError(f"path is too long ({len(path)} characters, limit {MAX_PATH_CHARS})")
    if "\0" in path:
        raise HttpError("path must not contain a NUL character")
    p = Path(path)
    if ".." in p.parts:
        raise HttpError("path must not contain '..'", 403, "permission_error")
    if p.is_absolute():
        candidates = [_resolved(p)]
    else:
        candidates = [_resolved(r / p) for r in roots]
        existing = [c for c in candidates if _inside(c, roots) and os.path.lexists(c)]
        candidates = existing[:1] or candidates
    target = candidates[0]
    if not _inside(target, roots):
        raise HttpError(
            f"path {printable(path)} is outside the adapter folders "
            f"({', '.join(str(r) for r in roots)}; see --lora-dir)",
            403,
            "permission_error",
        )
    return target


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
        raise HttpError(
            f"path {printable(str(p))} cannot be resolved: {type(e).__name__}"
        ) from None


def _inside(p: Path, roots: list[Path]) -> bool:
    return any(p == r or p.is_relative_to(r) for r in roots)


def split_host(host_header: str) -> str:
    """The host part of a Host header (``[::1]:8080`` -> ``::1``), lower-cased."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end != -1 else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_origin(origin: str) -> bool:
    """An http(s) origin whose host is localhost or a loopback address, any port."""
    try:
        u = urlsplit(origin)
        u.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        return False
    return u.scheme in ("http", "https") and is_loopback((u.hostname or "").rstrip("."))


def host_allowed(host_header: str | None, bind_host: str) -> bool:
    """localhost, any loopback address, or the host we were told to bind. When bound
    to every interface (0.0.0.0 / ::), any IP-literal Host is fine as well: DNS
    rebinding needs a domain name, never an IP literal."""
    if not host_header:
        return False
    host = split_host(host_header)
    if is_loopback(host):
        return True
    bind = split_host(bind_host) if bind_host else ""
    if bind and host == bind:
        return True
    if bind in WILDCARD_HOSTS:
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            return False
    return False


def api_key_ok(request: web.Request, keys: list[str]) -> bool:
    given = ""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    elif "x-api-key" in request.headers:
        given = request.headers["x-api-key"].strip()
    ok = False
    # aiohttp decodes header bytes that are not UTF-8 as lone surrogates: encode them
    # back to those bytes, which then match no key (a 401, never a UnicodeEncodeError)
    g = given.encode("utf-8", "surrogateescape")
    for k in keys:  # compare against every key so timing says nothing about which matched
        ok |= hmac.compare_digest(g, k.encode("utf-8"))
    return ok and bool(given)


# the header line aiohttp quotes in a parse error: b'Authorization: Bearer ...'
_KEY_HEADER_LINE = re.compile(r"\n\s*b?['\"](authorization|x-api-key)\s*:", re.IGNORECASE)


def malformed_request(exc: BaseException, api_keys: list[str]) -> tuple[int, dict, str]:
    """The answer to a request aiohttp could not parse (a control character in a
    header, a line too long, ...): (status, JSON body, what the log line says).

    aiohttp's own answer quotes the offending header line, an API key included, in a
    plain-text 400 and in an ERROR traceback. Here neither the body nor the log holds
    any of the request's bytes, only the kind of fault. A fault inside the API key's
    own header, with keys set, is answered as a wrong key is: 401."""
    text = str(getattr(exc, "message", "") or exc)
    if api_keys and _KEY_HEADER_LINE.search(text):
        body = error_body("Invalid API Key", 401, "authentication_error")
        return 401, body, "401 (malformed API key header)"
    # the fault's name: the first line, up to any quoted bytes
    first = text.split("\n", 1)[0]
    reason = re.split(r"\s*b?['\"]", first, maxsplit=1)[0].strip().rstrip(":").strip()
    reason = printable(reason or "Bad Request", 200)
    body = error_body(f"malformed request: {reason}", 400, "invalid_request_error")
    return 400, body, f"400 (malformed request: {reason})"


def same_origin(origin: str, host_header: str | None) -> bool:
    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        return False
    return bool(host_header) and netloc == host_header.strip().lower()


def public_paths(settings) -> frozenset[str]:
    """The paths that need no API key: /health, and the web UI's static files when it
    is served (the page, its manifest, service worker, icon and version.json carry no
    data; the page asks for the key when an API call answers 401). Exact paths only:
    every API route still needs the key. With --no-webui those paths are unknown, so
    they need the key like any other (and then answer 404)."""
    return PUBLIC_PATHS | WEBUI_PATHS if settings.webui else PUBLIC_PATHS


def json_error(message: str, code: int, type: str, **extra) -> web.Response:
    return web.json_response(error_body(message, code, type, **extra), status=code)


def make_middlewares(settings, on_line: Callable[[str], None]) -> list:
    """The middleware chain for ``settings`` (a ServerSettings)."""
    allowed_origins = set(settings.cors_origins)
    allow_any_origin = "*" in allowed_origins
    allow_loopback = "localhost" in allowed_origins
    public = public_paths(settings)

    def origin_listed(origin: str) -> bool:
        return (
            allow_any_origin
            or origin in allowed_origins
            or (allow_loopback and loopback_origin(origin))
        )

    @web.middleware
    async def request_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        """One line per request: method, path, status, milliseconds. Never the body."""
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except (ConnectionError, asyncio.CancelledError):
            request[DISCONNECTED] = True
            raise
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            status_s = "499 (client disconnected)" if request.get(DISCONNECTED) else str(status)
            note = f" ({request[LOG_NOTE]})" if LOG_NOTE in request else ""
            on_line(f"{request.method} {printable(request.path)} {status_s} {ms:.1f} ms{note}")

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure becomes llama-server's {"error": {...}} JSON; the server lives on."""
        from ..serve.engine import EngineError

        try:
            return await handler(request)
        except HttpError as e:
            return json_error(e.message, e.code, e.type, **e.extra)
        except EngineError as e:
            return json_error(str(e), e.code, e.type)
        except web.HTTPRequestEntityTooLarge:
            return json_error(
                f"request body too large (limit {settings.max_body} bytes)",
                413,
                "invalid_request_error",
            )
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
                e.status, "invalid_request_error"
            )
            msg = "no such endpoint" if e.status == 404 else e.reason
            return json_error(f"{msg}: {request.method} {printable(request.path)}", e.status, kind)
        except UserError as e:  # AdapterError, SamplingError, ChatTemplateError, TokenizerError
            return json_error(str(e), 400, "invalid_request_error")
        except (ConnectionError, TimeoutError):
            raise
        except Exception as e:
            log.exception("internal error on %s %s", request.method, request.path)
            return json_error(f"internal server error: {type(e).__name__}", 500, "server_error")

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not any(host_allowed(host, h) for h in settings.hosts):
            return json_error(
                "Host header not allowed (DNS rebinding protection); use localhost or 127.0.0.1",
                403,
                "permission_error",
            )
        origin = request.headers.get("Origin")
        if (
            request.method == "OPTIONS"
            and origin is not None
            and "Access-Control-Request-Method" in request.headers
        ):
            if not allowed_origins or not origin_listed(origin):
                # llama-server's answer (its own tests assert the 200): no CORS headers,
                # which the browser reads as "no". The log says what happened, as
                # llama-server's "(CORS) skip non-localhost origin" warning does.
                request[LOG_NOTE] = f"CORS: origin {printable(origin)} refused, see --cors-origins"
                return web.Response(status=200)
            return web.Response(status=200, headers=cors_headers(origin, preflight=True))
        if origin is not None and not origin_listed(origin) and not same_origin(origin, host):
            return json_error(
                f"Origin {origin} not allowed (see --cors-origins)", 403, "permission_error"
            )
        if origin is not None and allowed_origins and origin_listed(origin):
            request[CORS_ORIGIN] = origin
        length = request.content_length
        if length is not None and length > settings.max_body:
            return json_error(
                f"request body too large ({length} bytes, limit {settings.max_body})",
                413,
                "invalid_request_error",
            )
        if (
            settings.api_keys
            and request.path not in public
            and not api_key_ok(request, settings.api_keys)
        ):
            return json_error("Invalid API Key", 401, "authentication_error")
        return await handler(request)

    return [request_log, errors, guard]


def cors_headers(origin: str, preflight: bool = False) -> dict[str, str]:
    h = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        h.update(
            {
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Api-Key, X-Conversation-Id",
                "Access-Control-Max-Age": "600",
            }
        )
    return h


async def add_cors_on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare hook: CORS headers for listed origins, streams included."""
    origin = request.get(CORS_ORIGIN)
    if origin and "Access-Control-Allow-Origin" not in response.headers:
        response.headers.update(cors_headers(origin))
