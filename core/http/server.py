"""Running the app: ``python main.py --headless`` and a background-thread server.

* :func:`run_headless` serves on the asyncio loop of the main thread. It binds
  first and loads the model afterwards, so /health answers 503 while loading.
* :func:`start_site` starts the app on an already running loop (the GUI's qasync
  loop) and returns the runner to clean up.
* :class:`ServerThread` runs the app on its own loop in a daemon thread (tests,
  scripts, notebooks).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .app import REQUEST_LOG, SETTINGS, ServerSettings, create_app, set_engine
from .security import WILDCARD_HOSTS, is_loopback, malformed_request, split_host

log = logging.getLogger("mixdesk.http")


class _Protocol(web.RequestHandler):
    """aiohttp's per-connection handler, with two of its answers changed:

    * a request it cannot parse: aiohttp answers a plain-text 400 that quotes the
      offending header line (an API key with it) and logs that line in an ERROR
      traceback; here it is llama-server's JSON error and one INFO line naming only
      the kind of fault (:func:`security.malformed_request`).
    * a client gone while its handler ran (a ConnectionResetError out of
      ``request.read()``): aiohttp logs a 45-line traceback per client; here the
      request log's "499 (client disconnected)" line is all, and the connection is
      dropped the way aiohttp drops one that vanished while its answer was written.
    """

    def handle_error(self, request, status=500, exc=None, message=None):
        if isinstance(exc, ConnectionError):
            raise exc  # RequestHandler.start() drops the connection without a log line
        if isinstance(exc, HttpProcessingError) and status == 400:
            app = self._manager.app
            code, body, what = malformed_request(exc, app[SETTINGS].api_keys)
            app[REQUEST_LOG](f"malformed request from {request.remote}: {what}")
            resp = web.json_response(body, status=code)
            resp.force_close()  # the rest of the stream cannot be trusted
            return resp
        return super().handle_error(request, status, exc, message)


class _Server(web.Server):
    app: web.Application

    def __call__(self) -> _Protocol:
        return _Protocol(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    """An AppRunner whose connections are served by :class:`_Protocol`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # the very server aiohttp built (it has no hook for the handler class), with
        # only its connection factory replaced
        server.__class__ = _Server
        server.app = self.app
        return server


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving ``app``; returns (runner, the bound port). port 0 picks a free one.
    A client that disconnects cancels its handler (which frees its engine slot)."""
    settings = app.get(SETTINGS) or ServerSettings()
    # keepalive_timeout also closes a connection whose request headers are still
    # incomplete after that long (a slowloris client sending them byte by byte)
    runner = _Runner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=2.0,
        keepalive_timeout=settings.idle_timeout,
    )
    await runner.setup()
    bound = port
    try:
        # --host a,b binds each address, on one port (port 0: the one the first got)
        for h in [x.strip() for x in host.split(",") if x.strip()] or [host]:
            await web.TCPSite(runner, h, bound).start()
            if bound == 0:
                bound = next((s[1] for s in runner.addresses if isinstance(s, tuple)), 0)
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound


def exposure_warnings(settings: ServerSettings) -> list[str]:
    """Warnings for binding beyond loopback (and doing so without an API key)."""
    out: list[str] = []
    exposed = [h for h in settings.hosts if h in WILDCARD_HOSTS or not is_loopback(split_host(h))]
    if exposed:
        where = (
            "every network interface"
            if any(h in WILDCARD_HOSTS for h in exposed)
            else ", ".join(exposed)
        )
        out.append(
            f"WARNING: listening on {where}: other machines on the network can use this server"
        )
        if not settings.api_keys:
            out.append(
                "WARNING: no --api-key set: anyone who can reach this address can "
                "generate text and load or change adapters"
            )
        if settings.allow_runtime_lora:
            out.append(
                "WARNING: --allow-runtime-lora on a network address: clients can load any "
                "adapter file from " + ", ".join(str(d) for d in settings.lora_dirs)
            )
    return out


def run_headless(args) -> int:
    """``main.py --headless``: serve the HTTP API until SIGINT/SIGTERM."""
    settings = ServerSettings.from_args(args)
    for w in exposure_warnings(settings):
        print(f"mixdesk: {w}", file=sys.stderr)
    try:
        return asyncio.run(_serve_headless(args, settings))
    except KeyboardInterrupt:
        return 0


async def _serve_headless(args, settings: ServerSettings) -> int:
    from ..startup import engine_from_args

    app = create_app(None, settings)
    runner, port = await start_site(app, settings.host, settings.port)
    for h in settings.hosts:
        shown = f"[{h}]" if ":" in h else h
        log.info("listening on http://%s:%d (loading the model...)", shown, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # Windows: KeyboardInterrupt instead
            pass
    eng = None
    try:
        load = loop.run_in_executor(
            None, lambda: engine_from_args(args, say=lambda m: log.info("%s", m))
        )
        waiter = asyncio.ensure_future(stop.wait())
        finished, _ = await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if load not in finished:
            log.info("interrupted while loading the model")
            return 0
        eng = load.result()  # raises the load error (a ValueError) as is
        eng.start()
        set_engine(app, eng)
        info = eng.model_info()
        log.info(
            "model %s loaded: n_ctx %d, %d slots, KV cache %s/%s (keys/values), "
            "%d adapter(s); ready",
            info.get("name"),
            eng.ctx_size,
            eng.n_parallel,
            info.get("cache_type_k"),
            info.get("cache_type_v"),
            len(eng.adapters()),
        )
        await waiter
        log.info("shutting down")
        return 0
    finally:
        await runner.cleanup()
        if eng is not None:
            eng.stop()


class ServerThread:
    """The app served from a daemon thread with its own event loop.

    srv = ServerThread(engine, ServerSettings(port=0)).start()
    ... srv.url ...
    srv.stop()
    """

    def __init__(self, engine, settings: ServerSettings | None = None):
        self.engine = engine
        self.settings = settings or ServerSettings(port=0)
        self.port: int | None = None
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        first = self.settings.hosts[0]
        host = first if first not in WILDCARD_HOSTS else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread = threading.Thread(target=self._run, name="mixdesk-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("HTTP server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def boot():
            self.app = create_app(self.engine, self.settings)
            self._runner, self.port = await start_site(
                self.app, self.settings.host, self.settings.port
            )

        try:
            loop.run_until_complete(boot())
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def set_engine(self, engine) -> None:
        self.engine = engine
        if self._loop is not None and self.app is not None:
            self._loop.call_soon_threadsafe(set_engine, self.app, engine)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
