"""The aiohttp application: llama-server's endpoints, OpenAI's, and the LoRA extras.

``create_app(engine, settings)`` builds it; the headless server and the GUI (on
its qasync loop) run the same app. The engine may be None while the model is
still loading: every endpoint then answers 503 ``unavailable_error``; call
``set_engine(app, engine)`` once it is ready.

Generation never blocks the event loop: requests go to the engine's scheduler
thread, whose events come back through ``loop.call_soon_threadsafe`` into an
asyncio.Queue. A client that goes away cancels its request, which frees its slot.

Other blocking work a client can trigger (loading an adapter, rendering a chat
template, tokenizing a long text) runs on a :class:`BlockingPool` of its own kind:
a few daemon threads, a short bounded queue (beyond it: 503, busy) and a time
limit per call, so no client can tie up a shared executor or the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from ..chat_template import build_prompt
from ..errors import UserError
from ..options import DEFAULT_BATCH, DEFAULT_HOST, DEFAULT_PORT
from ..serve.embeddings import check_pooling, packed
from ..serve.grammar import request_constraint, wants_constraint
from ..serve.relay import LoopRelay
from ..serve.sampling import SamplingParams, parse_logit_bias
from ..serve.scheduler import DoneEvent, TokenEvent
from . import embeddings as EMB
from . import endpoints as E
from . import responses as R
from . import streams as S
from .build_info import build_info
from .responses import HttpError
from .security import (
    DISCONNECTED,
    adapter_path,
    add_cors_on_prepare,
    make_middlewares,
    printable,
    runtime_lora_off,
)
from .webui import add_webui_routes

log = logging.getLogger("mixdesk.http")


@dataclass
class ServerSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)
    alias: str | None = None
    n_predict_default: int = -1
    n_batch: int = DEFAULT_BATCH  # -b: /infill fits its prefix and suffix in one batch
    verbose: bool = False
    max_body: int = 8 << 20
    lora_init_without_apply: bool = False
    on_log: Callable[[str], None] | None = None
    # POST /lora-adapters/load and /v1/load_lora_adapter open a path the client
    # names: off unless asked for, and then only inside these folders
    allow_runtime_lora: bool = False
    lora_dirs: list[Path] = field(default_factory=list)
    # a connection idle (or still sending its headers) this long is closed, and a
    # body must arrive within body_timeout: slow clients cannot hold connections
    idle_timeout: float = 30.0
    body_timeout: float = 60.0
    adapter_load_timeout: float = 120.0
    # the sampling flags (--temp, --seed, ...): what a request's absent fields take
    sampling: SamplingParams | None = None
    aliases: list[str] = field(default_factory=list)  # --alias a,b: /v1/models aliases
    tags: list[str] = field(default_factory=list)  # --tags
    slots: bool = True  # GET /slots (--no-slots: 501)
    slot_save_path: Path | None = None  # POST /slots/{id}?action=save|restore
    # a slot action on a busy slot waits for it (as llama-server's), then answers 409
    slot_wait: float = 600.0
    metrics: bool = False  # GET /metrics (--metrics)
    webui: bool = True  # the chat page at / and its assets (--no-webui / --no-ui: 404)

    @classmethod
    def from_args(cls, args) -> ServerSettings:
        from ..paths import data_dir
        from .security import default_lora_dirs

        allow = bool(getattr(args, "allow_runtime_lora", False))
        dirs = [Path(d) for d in getattr(args, "lora_dir", None) or []]
        if allow and not dirs:
            given = [p for p, _ in getattr(args, "adapters", [])]
            dirs = default_lora_dirs(given, data_dir() / "adapters")
        from ..options import EngineOptions

        timeout = getattr(args, "timeout", None)
        save = getattr(args, "slot_save_path", None)
        return cls(
            host=args.host,
            port=args.port,
            api_keys=list(args.api_key or []),
            cors_origins=list(args.cors_origins or []),
            alias=args.alias,
            n_predict_default=args.n_predict,
            n_batch=getattr(args, "batch_size", None) or DEFAULT_BATCH,
            verbose=bool(args.verbose),
            lora_init_without_apply=bool(getattr(args, "lora_init_without_apply", False)),
            allow_runtime_lora=allow,
            lora_dirs=dirs,
            body_timeout=float(timeout) if timeout else 60.0,
            sampling=EngineOptions.sampling(args),
            aliases=list(getattr(args, "aliases", None) or []),
            tags=list(getattr(args, "tags", None) or []),
            slots=bool(getattr(args, "slots", True)),
            slot_save_path=Path(save) if save else None,
            metrics=bool(getattr(args, "metrics", False)),
            webui=bool(getattr(args, "webui", True)),
        )

    @property
    def hosts(self) -> list[str]:
        """--host may list several addresses (comma-separated): each one is bound."""
        return [h.strip() for h in self.host.split(",") if h.strip()] or [self.host]


class BlockingPool:
    """Blocking calls of one kind (adapter loads, chat templates, tokenizing) run on at
    most ``workers`` daemon threads; at most ``queue`` more calls wait for one, and a
    call beyond that is refused at once with 503 (busy). A call still running after
    ``timeout`` seconds is answered 503 too; its thread keeps its place until it
    really ends, so a hung call (a file that never finishes reading) can only ever
    block this pool, never the event loop or the other kinds of work. Daemon
    threads: a hung call does not keep the process alive at exit."""

    def __init__(self, kind: str, workers: int, queue: int, timeout: float):
        self.kind, self.workers, self.queue, self.timeout = kind, workers, queue, timeout
        self._sem: asyncio.Semaphore | None = None
        self._waiting = 0

    def _busy(self, why: str) -> HttpError:
        return HttpError(f"server busy: {why}; retry later", 503, "unavailable_error")

    async def run(self, fn, *args):
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.workers)
        sem = self._sem
        if sem.locked() and self._waiting >= self.queue:
            raise self._busy(f"too many {self.kind} requests at once")
        self._waiting += 1
        try:
            await sem.acquire()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(ok: bool, value) -> None:
            sem.release()  # the thread's place is free only once it has ended
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def work() -> None:
            try:
                ok, value = True, fn(*args)
            except BaseException as e:  # handed to the awaiting handler
                ok, value = False, e
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is gone (server stopped)
                pass

        try:
            threading.Thread(target=work, name=f"mixdesk-{self.kind}", daemon=True).start()
        except BaseException:
            sem.release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError:
            raise self._busy(f"{self.kind} took longer than {self.timeout:g} s") from None


class _EngineBox:
    """Mutable holder: the app's state must not change once it runs, the engine may."""

    def __init__(self, engine):
        self.engine = engine

    def model_info(self) -> dict:
        return self.engine.model_info()


ENGINE = web.AppKey("engine", _EngineBox)
SETTINGS = web.AppKey("settings", ServerSettings)
REQUEST_LOG = web.AppKey("request_log", Callable[[str], None])  # one line per request
LOAD_LOCK = web.AppKey("load_lock", asyncio.Lock)
ADAPTER_POOL = web.AppKey("adapter_pool", BlockingPool)
TEXT_POOL = web.AppKey("text_pool", BlockingPool)
MIX_POOL = web.AppKey("mix_pool", BlockingPool)
METRICS = web.AppKey("metrics", E.Metrics)
RELAY = web.AppKey("relay", LoopRelay)  # engine events to this app's loop, once per step
STREAMS = web.AppKey("streams", S.StreamSessions)  # resumable streams by X-Conversation-Id

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
TOKENIZE_INLINE_CHARS = 16384


def create_app(engine, settings: ServerSettings | None = None) -> web.Application:
    settings = settings or ServerSettings()

    def on_line(line: str) -> None:
        log.info("%s", line)
        if settings.on_log is not None:
            try:
                settings.on_log(line)
            except Exception:
                log.exception("on_log callback failed")

    app = web.Application(
        middlewares=make_middlewares(settings, on_line), client_max_size=settings.max_body
    )
    app[ENGINE] = _EngineBox(engine)
    app[SETTINGS] = settings
    app[REQUEST_LOG] = on_line
    app[LOAD_LOCK] = asyncio.Lock() if _has_loop() else None  # created lazily otherwise
    app[ADAPTER_POOL] = BlockingPool(
        "adapter load", workers=2, queue=4, timeout=settings.adapter_load_timeout
    )
    # chat templates stop themselves (RenderLimits); the timeout is a backstop
    app[TEXT_POOL] = BlockingPool("text", workers=2, queue=64, timeout=60.0)
    # merge-method builds: one at a time (each already keeps both cores busy in BLAS),
    # a bounded queue (a client sending new seeds cannot pile up threads), and a build
    # that outlasts the timeout still lands in the mix cache for the retry
    app[MIX_POOL] = BlockingPool("mix build", workers=1, queue=16, timeout=600.0)
    app[METRICS] = E.Metrics()
    app[RELAY] = LoopRelay()  # bound to the serving loop by the first generation
    app[STREAMS] = S.StreamSessions()
    app.on_shutdown.append(_close_streams)
    app.on_response_prepare.append(add_cors_on_prepare)
    r = app.router
    r.add_get("/health", health)
    r.add_get("/v1/health", health)
    r.add_get("/props", props)
    r.add_get("/v1/models", models)
    r.add_get("/models", models)
    r.add_get("/lora-adapters", get_lora)
    r.add_post("/lora-adapters", post_lora)
    r.add_get("/mixdesk/mix", get_mixdesk_mix)
    r.add_post("/lora-adapters/load", lora_load)
    r.add_post("/lora-adapters/unload", lora_unload)
    r.add_post("/v1/load_lora_adapter", vllm_load)
    r.add_post("/v1/unload_lora_adapter", vllm_unload)
    r.add_post("/completion", completion)
    r.add_post("/completions", completion)
    r.add_post("/v1/completions", oai_completions)
    r.add_post("/chat/completions", chat_completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/chat/completions/input_tokens", chat_input_tokens)
    r.add_post("/v1/chat/completions/input_tokens", chat_input_tokens)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/apply-template", apply_template)
    r.add_get("/slots", slots)
    r.add_post("/slots/{id_slot}", slots_action)
    r.add_get("/metrics", metrics)
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        r.add_post(path, embeddings)
    r.add_post("/infill", infill)
    r.add_get("/v1/stream", stream_replay)
    r.add_delete("/v1/stream", stream_delete)
    r.add_post("/v1/streams/lookup", streams_lookup)
    from .grid import grid  # imported here: core/http/grid.py builds on this module

    r.add_post("/mixdesk/grid", grid)  # the X/Y grid of mixes (#21)
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        r.add_post(path, rerank)
    if settings.webui:
        add_webui_routes(r)  # the chat page at / (llama-server's web UI)
    return app


async def _close_streams(app: web.Application) -> None:
    app[STREAMS].close()  # producers cancelled, replay readers woken


def set_engine(app: web.Application, engine) -> None:
    """Hand the app its engine once the model is loaded (until then: 503)."""
    app[ENGINE].engine = engine


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


# ---- helpers -------------------------------------------------------------------------


def _engine(request: web.Request):
    eng = request.app[ENGINE].engine
    if eng is None or not eng.ready:
        loading = eng is None or eng.loading
        raise HttpError("Loading model" if loading else "no model loaded", 503, "unavailable_error")
    return eng


def _settings(request: web.Request) -> ServerSettings:
    return request.app[SETTINGS]


async def _read(request: web.Request) -> bytes:
    """The body, which must arrive within body_timeout (a client trickling its body
    byte by byte cannot hold a handler forever)."""
    timeout = _settings(request).body_timeout
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise HttpError(
            f"the request body did not arrive within {timeout:g} s", 408, "invalid_request_error"
        ) from None


async def _body(request: web.Request) -> dict:
    return R.parse_json_body(await _read(request))


def _model_id(request: web.Request, eng) -> str:
    s = _settings(request)
    return s.alias or (Path(eng.path).name if eng.path else "mixdesk")


def _verbose(request: web.Request, what: str, text: Callable[[], str]) -> None:
    """--verbose logging; ``text`` is only computed when it is logged."""
    if _settings(request).verbose:
        log.info("%s %s: %r", printable(request.path), what, text())


async def _encode_prompt(request: web.Request, eng, prompt: Any) -> list[int]:
    size = (
        len(prompt)
        if isinstance(prompt, str)
        else sum(len(x) for x in prompt if isinstance(x, str))
        if isinstance(prompt, list)
        else 0
    )
    if size > TOKENIZE_INLINE_CHARS:
        ids = await request.app[TEXT_POOL].run(R.parse_prompt, prompt, eng.tokenizer)
    else:
        ids = R.parse_prompt(prompt, eng.tokenizer)
    R.check_prompt_tokens(ids, eng.config.vocab_size)
    return ids


async def _render_chat(request: web.Request, eng, body: dict) -> str:
    """The prompt text llama-server builds for a chat request (build_prompt, the one
    prompt path the window shares), off the event loop and under the render limits."""
    msgs = R.parse_messages(body)
    opts = R.parse_chat_options(body)
    return await request.app[TEXT_POOL].run(
        lambda: build_prompt(
            eng.chat_template,
            msgs,
            add_generation_prompt=opts.add_generation_prompt,
            continue_final_message=opts.continue_final_message,
            tools=opts.tools,
            template_kwargs=opts.template_kwargs,
            defaults=eng.chat_defaults,
        )
    )


async def _mixes_ready(request: web.Request, eng, mixes: list) -> None:
    """Build, on the mix-build pool's thread, any of these mixes (None: the global mix)
    that is not built yet, so that the submit that follows finds them built. A merge
    method's build takes seconds (27 s for ties on Qwen2.5-0.5B): run inside the
    submit, on this loop, it stopped every other client (and, in the window, the GUI)
    until it ended."""
    if not eng.mixes_built(mixes):
        await request.app[MIX_POOL].run(eng.prepare_mixes, mixes)


def _resolve_mix(eng, opts: R.GenOptions, oai: bool) -> dict[int, float] | None:
    """The mix for one request: its "lora" list (unlisted ids 0, [] all off); else,
    on OpenAI endpoints, "model": "<adapter name>" selects that adapter alone at
    scale 1 (vLLM); else None, the global mix."""
    if opts.lora is not None:
        return eng.parse_mix(opts.lora, "lora")
    if oai and opts.model:
        ads = eng.adapters()
        match = [a["id"] for a in ads if a.get("name") == opts.model]
        if match:
            return {a["id"]: (1.0 if a["id"] == match[0] else 0.0) for a in ads}
    return None


def _refused(e: BaseException, prompt: list[int], eng) -> BaseException:
    """What a refused submit answers: a prompt too long for the context is llama-server's
    400 (its wording and fields: scripts match on them); anything else as it is."""
    from ..serve.engine import EngineError

    if isinstance(e, EngineError) and e.type == "exceed_context_size_error":
        return HttpError(
            "the request exceeds the available context size, try increasing it",
            400,
            e.type,
            n_prompt_tokens=len(prompt),
            n_ctx=eng.ctx_size,
        )
    return e


_CLIENT_GONE = object()  # queued by _Generation._watch: the client went away


class _Generation:
    """One submitted request whose engine events arrive on an asyncio.Queue."""

    def __init__(
        self,
        request: web.Request,
        eng,
        prompt: list[int],
        params: SamplingParams,
        mix,
        cache_prompt: bool,
        submit: bool = True,
        id_slot: int = -1,
        progress: bool = False,
    ):
        loop = asyncio.get_running_loop()
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()

        def lost() -> None:  # scheduler thread: the loop is gone, stop generating
            r = getattr(self, "req", None)
            if r is not None:
                r.cancel()

        # one wake-up of this loop per scheduler step for all requests (core/serve/relay.py)
        relay = request.app[RELAY]
        relay.bind(loop)
        self.on_event = relay.sender(self.queue.put_nowait, lost)
        self.done: DoneEvent | None = None
        self._watchdog: asyncio.TimerHandle | None = None  # next()'s client check
        if not submit:
            return  # many() submits the whole batch at once
        try:
            self.req = eng.submit(
                prompt,
                params,
                self.on_event,
                mix=mix,
                cache_prompt=cache_prompt,
                source="http",
                id_slot=id_slot,
                progress=progress,
            )
        except Exception as e:
            raise _refused(e, prompt, eng) from None

    @classmethod
    def many(cls, request, eng, jobs: list[tuple[list[int], SamplingParams]], mix, cache_prompt):
        """Several generations (n choices, several prompts) submitted together with
        Engine.submit_many, so the scheduler admits them in the same step and they run
        as one batch. If any is refused, none runs."""
        gens = [cls(request, eng, p, params, mix, cache_prompt, submit=False) for p, params in jobs]
        got = eng.submit_many(
            [
                dict(
                    prompt=p,
                    params=params,
                    on_event=g.on_event,
                    mix=mix,
                    cache_prompt=cache_prompt,
                    source="http",
                )
                for g, (p, params) in zip(gens, jobs)
            ]
        )
        bad = [(e, p) for e, (p, _) in zip(got, jobs) if isinstance(e, BaseException)]
        if bad:
            for r in got:
                if not isinstance(r, BaseException):
                    r.cancel()
            raise _refused(bad[0][0], bad[0][1], eng)
        for g, r in zip(gens, got):
            g.req = r
        return gens

    def _client_gone(self) -> bool:
        t = self.request.transport
        return t is None or t.is_closing()

    async def next(self, watch_client: bool = True):
        """The next event; cancels the request if the client disconnected meanwhile.
        The client is checked by one timer per request every POLL_S (_watch), not by
        a wait_for (a task and a timer) around every event, which was 40% of the loop
        thread's time under 8 concurrent streams (py-spy, #22)."""
        if watch_client and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(POLL_S, self._watch)
        ev = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
        if ev is _CLIENT_GONE:
            raise ConnectionResetError("client disconnected")
        if isinstance(ev, DoneEvent):
            self.done = ev
            if ev.stop_type not in ("error", "cancel"):
                self.request.app[METRICS].record(ev)
        return ev

    def _watch(self) -> None:
        """Every POLL_S until the request is done or cancelled: a client that went
        away cancels it, and the handler's next() raises ConnectionResetError."""
        if self.done is not None or self.req.cancelled.is_set():
            return
        if self._client_gone():
            self.cancel()
            self.queue.put_nowait(_CLIENT_GONE)
            return
        self._watchdog = asyncio.get_running_loop().call_later(POLL_S, self._watch)

    def cancel(self) -> None:
        if self.done is None:
            self.request[DISCONNECTED] = True
            self.req.cancel()

    async def collect(self) -> tuple[DoneEvent, list[TokenEvent]]:
        toks: list[TokenEvent] = []
        try:
            while True:
                ev = await self.next()
                if isinstance(ev, DoneEvent):
                    return ev, toks
                if ev.kind == "token":
                    toks.append(ev)
        finally:
            self.cancel()


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


def _raise_for_done(done: DoneEvent) -> None:
    if done.stop_type == "error":
        raise HttpError(done.error or "generation failed", 500, done.error_type or "server_error")
    if done.stop_type == "cancel":
        raise HttpError(
            "the request was cancelled (server shutting down)", 503, "unavailable_error"
        )


def _stream_error(done: DoneEvent) -> dict:
    if done.stop_type == "error":
        return R.error_body(
            done.error or "generation failed", 500, done.error_type or "server_error"
        )
    return R.error_body("the request was cancelled", 503, "unavailable_error")


# ---- simple endpoints ----------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    ok, reason = _engine(request).health()  # 503 unless the engine loop is serving
    if not ok:
        raise HttpError(reason, 503, "unavailable_error")
    return web.json_response({"status": "ok"})


async def props(request: web.Request) -> web.Response:
    eng = _engine(request)
    s = _settings(request)
    mid = _model_id(request, eng)
    params = s.sampling or SamplingParams(n_predict=s.n_predict_default)
    lora = R.mix_to_lora(eng.get_mix())
    return web.json_response(
        {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": eng.ctx_size,
                "speculative": False,
                "is_processing": False,
                "params": R.generation_settings(params, eng.ctx_size, mid, False, lora),
            },
            "total_slots": eng.n_parallel,
            "model_path": str(eng.path),
            "model_alias": mid,
            "chat_template": eng.chat_template.source if eng.chat_template else "",
            "chat_template_caps": {},
            "bos_token": eng.chat_template.bos_token if eng.chat_template else "",
            "eos_token": eng.chat_template.eos_token if eng.chat_template else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": build_info(),
            "is_sleeping": False,
            "lora_init_without_apply": s.lora_init_without_apply,
        }
    )


async def slots(request: web.Request) -> web.Response:
    """GET /slots (--no-slots: 501); ?fail_on_no_slot answers 503 when all are busy."""
    s = _settings(request)
    if not s.slots:
        raise E.not_supported(
            "This server does not support slots endpoint. Start it with `--slots`"
        )
    eng = _engine(request)
    if "fail_on_no_slot" in request.query and E.idle_slots(eng) == 0:
        raise HttpError("no slot available", 503, "unavailable_error")
    return web.json_response(E.slots_list(eng))


async def slots_action(request: web.Request) -> web.Response:
    eng = _engine(request)
    action = request.query.get("action")
    body = await _body(request) if action in ("save", "restore") else {}
    out = await E.slot_action(eng, _settings(request), request.match_info["id_slot"], action, body)
    return web.json_response(out)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text with llama-server's names (--metrics; else 501)."""
    if not _settings(request).metrics:
        raise E.not_supported(
            "This server does not support metrics endpoint. Start it with `--metrics`"
        )
    eng = _engine(request)
    return web.Response(
        text=request.app[METRICS].prometheus(eng.stats()),
        content_type="text/plain",
        charset="utf-8",
        headers={"Process-Start-Time-Unix": str(E.PROCESS_START)},
    )


async def embeddings(request: web.Request) -> web.Response:
    """/embedding, /embeddings (llama-server's form) and /v1/embeddings (OpenAI's):
    the final hidden states under the request's ``lora`` or the global mix, pooled by
    --pooling (core/serve/embeddings.py). 501 without --embedding."""
    eng = _engine(request)
    opts = eng.embeddings
    if not opts.enabled:
        raise E.not_supported(
            "This server does not support embeddings. Start it with `--embeddings`"
        )
    pooling = check_pooling(opts.pooling_for(eng.config))
    oai = request.path.startswith("/v1/")
    if oai and pooling == "none":
        raise HttpError(EMB.NOT_OAI_POOLING)
    body = await _body(request)
    if (request.content_length or 0) > TOKENIZE_INLINE_CHARS:  # long texts: off the loop
        inputs, content = await request.app[TEXT_POOL].run(EMB.parse_inputs, body, eng.tokenizer)
    else:
        inputs, content = EMB.parse_inputs(body, eng.tokenizer)
    b64 = EMB.parse_encoding(body)
    norm = EMB.parse_normalize_field(body)
    mix = eng.parse_mix(body["lora"], "lora") if body.get("lora") is not None else None
    await _mixes_ready(request, eng, [mix])
    t0 = time.perf_counter()
    hidden = await asyncio.wrap_future(eng.embed(inputs, mix))  # (n_i, d) per input
    request.app[METRICS].record_embedding(
        sum(len(ids) for ids in inputs),
        len(packed(inputs, opts.ubatch)),
        (time.perf_counter() - t0) * 1e3,
    )
    vectors = EMB.pooled(hidden, pooling, norm)
    if oai and not content:
        model = body.get("model") if isinstance(body.get("model"), str) else None
        counts = [len(ids) for ids in inputs]
        return web.json_response(
            EMB.oai_body(vectors, counts, model or _model_id(request, eng), b64)
        )
    return web.json_response(EMB.native_body(vectors))


async def infill(request: web.Request) -> web.Response:
    """/infill needs the model's fill-in-the-middle tokens (501 without them)."""
    missing = E.missing_fim_tokens(_engine(request).tokenizer)
    if missing:  # before the body is read: the answer does not depend on it
        raise E.not_supported(f"Infill is not supported by this model: {missing}")
    s = _settings(request)
    layout = partial(E.infill_prompt, n_batch=s.n_batch, n_predict=s.n_predict_default)
    return await completion(request, prompt_field=layout)


async def rerank(request: web.Request) -> web.Response:
    raise E.not_supported("This server does not support reranking. Start it with `--reranking`")


async def models(request: web.Request) -> web.Response:
    eng = _engine(request)
    s = _settings(request)
    return web.json_response(
        R.models_list(
            _model_id(request, eng),
            request.app[ENGINE].model_info(),
            eng.adapters(),
            aliases=s.aliases,
            tags=s.tags,
        )
    )


async def tokenize(request: web.Request) -> web.Response:
    eng = _engine(request)
    body = await _body(request)
    content = R.get_str(body, "content", required=True)
    add_special = R.get_bool(body, "add_special", False)
    parse_special = R.get_bool(body, "parse_special", True)
    with_pieces = R.get_bool(body, "with_pieces", False)
    ids = (
        await request.app[TEXT_POOL].run(eng.tokenizer.encode, content, add_special, parse_special)
        if len(content) > TOKENIZE_INLINE_CHARS
        else eng.tokenizer.encode(content, add_special, parse_special)
    )
    if with_pieces:
        return web.json_response(
            {"tokens": [{"id": t, "piece": R.token_piece(eng.tokenizer, t)} for t in ids]}
        )
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    eng = _engine(request)
    body = await _body(request)
    ids = R.parse_token_list(body.get("tokens", []), eng.config.vocab_size)
    if len(ids) > TOKENIZE_INLINE_CHARS:
        text = await request.app[TEXT_POOL].run(
            partial(eng.tokenizer.decode, strip_prefix_space=False), ids
        )
    else:
        # llama-server's /detokenize joins the pieces as they are: a SentencePiece
        # model's leading space stays (decode() for display strips it)
        text = eng.tokenizer.decode(ids, strip_prefix_space=False)
    return web.json_response({"content": text})


async def apply_template(request: web.Request) -> web.Response:
    eng = _engine(request)
    body = await _body(request)
    return web.json_response({"prompt": await _render_chat(request, eng, body)})


# ---- adapters --------------------------------------------------------------------------


async def get_lora(request: web.Request) -> web.Response:
    eng = _engine(request)
    return web.json_response([R.lora_adapter_entry(a) for a in eng.adapters()])


async def post_lora(request: web.Request) -> web.Response:
    """Set the global mix. Validated in full first: an invalid body changes nothing."""
    eng = _engine(request)
    body = R.parse_json_any(await _read(request))
    mix = eng.parse_mix(body, "lora-adapters")
    eng.set_mix(mix, source="http")
    return web.json_response({"success": True})


async def get_mixdesk_mix(request: web.Request) -> web.Response:
    """The global mix in POST /lora-adapters' object form: {"adapters": [{"id", "scale"}],
    "method", and the method's parameters} (GET /lora-adapters stays llama-server's)."""
    eng = _engine(request)
    mix = eng.get_mix()
    return web.json_response({"adapters": R.mix_to_lora(mix), **mix.merge.as_dict()})


def _load_lock(app: web.Application) -> asyncio.Lock:
    if app[LOAD_LOCK] is None:
        app[LOAD_LOCK] = asyncio.Lock()
    return app[LOAD_LOCK]


_BYTES_LITERAL = re.compile(r"(?<!\w)b'(?:[^'\\]|\\.)*'" + r'|(?<!\w)b"(?:[^"\\]|\\.)*"')


def _no_file_bytes(message: str) -> str:
    """An error about a file a client named must not quote the file's bytes
    (``bad magic b'root'`` told anyone the start of any readable file)."""
    return _BYTES_LITERAL.sub("<bytes not shown>", message)


def _add_adapter(eng, path, scale: float, name: str | None) -> dict:
    """Load (blocking) and return the new adapter's entry, read in the same breath,
    so an unload of the new id racing this load cannot leave us without it."""
    aid = eng.add_adapter(path, scale, name)
    info = next((a for a in eng.adapters() if a["id"] == aid), None)
    if info is None:
        raise HttpError(
            f"adapter {aid} was unloaded by another request while it was being loaded",
            409,
            "invalid_request_error",
        )
    return info


async def _load_adapter(request: web.Request, path: str, scale: float, name: str | None) -> dict:
    s = _settings(request)
    if not s.allow_runtime_lora:
        raise runtime_lora_off()
    eng = _engine(request)
    target = adapter_path(path, s.lora_dirs)
    async with _load_lock(request.app):  # one load at a time: names stay unique
        if name is not None and any(a.get("name") == name for a in eng.adapters()):
            raise HttpError(f"an adapter named {name!r} is already loaded")
        try:
            return await request.app[ADAPTER_POOL].run(_add_adapter, eng, target, scale, name)
        except HttpError:
            raise
        except UserError as e:  # AdapterError, GGUFError, ...: the file's fault
            raise HttpError(_no_file_bytes(str(e))) from None
        except OSError as e:
            raise HttpError(
                f"adapter {printable(path)}: cannot read it ({e.strerror or type(e).__name__})"
            ) from None


async def lora_load(request: web.Request) -> web.Response:
    """POST /lora-adapters/load {"path", "scale"?, "name"?} -> the new GET entry."""
    body = await _body(request)
    path = R.get_str(body, "path", required=True)
    default = 0.0 if _settings(request).lora_init_without_apply else 1.0
    scale = R.get_float(body, "scale", default)
    name = R.get_str(body, "name")
    info = await _load_adapter(request, path, scale, name)
    return web.json_response(R.lora_adapter_entry(info))


async def lora_unload(request: web.Request) -> web.Response:
    eng = _engine(request)
    body = await _body(request)
    aid = R.get_int(body, "id", None)
    if aid is None:
        raise HttpError('"id" is required')
    eng.remove_adapter(aid)
    return web.json_response({"success": True})


async def vllm_load(request: web.Request) -> web.Response:
    """vLLM: {"lora_name", "lora_path"}. Loaded at scale 0: as in vLLM, it applies
    only to requests whose "model" names it."""
    body = await _body(request)
    name = R.get_str(body, "lora_name", required=True)
    path = R.get_str(body, "lora_path", required=True)
    if not name:
        raise HttpError("lora_name must not be empty")
    await _load_adapter(request, path, 0.0, name)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: web.Request) -> web.Response:
    eng = _engine(request)
    body = await _body(request)
    name = R.get_str(body, "lora_name")
    aid = R.get_int(body, "lora_int_id", None)
    if name is None and aid is None:
        raise HttpError('"lora_name" is required')
    found = [
        a
        for a in eng.adapters()
        if (name is not None and a.get("name") == name) or (name is None and a["id"] == aid)
    ]
    if not found:
        raise HttpError(
            f"The lora adapter '{name if name is not None else aid}' cannot be found.",
            404,
            "not_found_error",
        )
    eng.remove_adapter(found[0]["id"])
    return web.Response(text=f"Success: LoRA adapter '{found[0]['name']}' removed successfully.")


# ---- generation ------------------------------------------------------------------------


async def _sampling_fields(request: web.Request, eng, body: dict, params: SamplingParams) -> None:
    """logit_bias and structured output (grammar, json_schema, response_format) into
    params; a bad value is a 400 (SamplingError / GrammarError). The grammar compiles
    off the event loop: the first one per model builds the vocabulary index."""
    params.logit_bias = parse_logit_bias(
        body.get("logit_bias"), eng.tokenizer, eng.config.vocab_size
    )
    if wants_constraint(body):
        params.grammar = await request.app[TEXT_POOL].run(request_constraint, body, eng.tokenizer)


async def _start(request: web.Request, prompt_field: Any, oai: bool, chat: bool = False):
    eng = _engine(request)
    s = _settings(request)
    body = await _body(request)
    opts = R.parse_generation(body, s.n_predict_default, oai=oai, defaults=s.sampling)
    opts.extra["post_sampling"] = R.get_bool(body, "post_sampling_probs", False)
    opts.extra["response_fields"] = R.parse_response_fields(body)
    opts.extra["verbose"] = R.get_bool(body, "verbose", False) or s.verbose
    opts.extra["timings_per_token"] = R.get_bool(body, "timings_per_token", False)
    if oai:
        n_top = R.parse_oai_logprobs(body, chat)
        if n_top:
            opts.params.n_probs = max(opts.params.n_probs, n_top)
        opts.extra["n_top"] = n_top
        opts.extra["include_usage"] = R.parse_include_usage(body)
    await _sampling_fields(request, eng, body, opts.params)
    mix = _resolve_mix(eng, opts, oai)
    if chat:
        text = await _render_chat(request, eng, body)
        prompt = await _encode_prompt(request, eng, text)
        _verbose(request, "prompt", lambda: text)
    elif callable(prompt_field):  # /infill builds its tokens from its own fields
        prompt = prompt_field(eng, body)
        R.check_prompt_tokens(prompt, eng.config.vocab_size)
        _verbose(request, "prompt", lambda: eng.tokenizer.decode(prompt))
    else:
        if "prompt" not in body:
            raise HttpError('"prompt" is required')
        if R.is_multi_prompt(body["prompt"]):
            R.check_choices(len(body["prompt"]), opts.extra["n"])
            prompts = [await _encode_prompt(request, eng, p) for p in body["prompt"]]
            await _mixes_ready(request, eng, [mix])
            return eng, opts, prompts, _start_many(request, eng, opts, prompts, mix)
        prompt = await _encode_prompt(request, eng, body["prompt"])
        _verbose(request, "prompt", lambda: eng.tokenizer.decode(prompt))
    await _mixes_ready(request, eng, [mix])
    if opts.extra["n"] > 1:
        return eng, opts, [prompt], _start_many(request, eng, opts, [prompt], mix)
    gen = _Generation(
        request,
        eng,
        prompt,
        opts.params,
        mix,
        opts.cache_prompt,
        id_slot=opts.id_slot,
        progress=opts.return_progress and opts.stream,
    )
    return eng, opts, prompt, gen


def _start_many(request, eng, opts, prompts: list[list[int]], mix) -> list[_Generation]:
    """n completions of each prompt, prompt-major (choice index = prompt * n + j), in one
    batch. With a seed, completion j of a prompt samples with seed + j: reproducible,
    and the n choices differ as OpenAI's n means."""
    n, p = opts.extra["n"], opts.params
    jobs = [
        (prompt, replace(p, seed=None if p.seed is None else p.seed + j))
        for prompt in prompts
        for j in range(n)
    ]
    return _Generation.many(request, eng, jobs, mix, opts.cache_prompt)


async def _start_oai(request: web.Request, id_prefix: str, chat: bool = False) -> tuple:
    """_start for the OpenAI routes, plus what their responses all carry:
    (eng, opts, prompt, gen, model id, all adapter ids, response id, created, n_top)."""
    eng, opts, prompt, gen = await _start(
        request, "messages" if chat else "prompt", oai=True, chat=chat
    )
    return (
        eng,
        opts,
        prompt,
        gen,
        opts.model or _model_id(request, eng),
        [a["id"] for a in eng.adapters()],
        R.new_id(id_prefix),
        int(time.time()),
        opts.extra["n_top"],
    )


def _oai_final(
    last: dict, prompt_n: int, ev: DoneEvent, all_ids, usage_chunk: bool = False
) -> list[bytes]:
    """The closing OpenAI chunk (usage, llama-server timings, the mix used) and [DONE].
    With ``stream_options.include_usage`` (``usage_chunk``), usage and timings come in
    one more chunk whose ``choices`` is empty, as OpenAI and llama-server send them."""
    extra = {
        "usage": R.usage(prompt_n, ev),
        "timings": R.timings(ev.timings),
        "lora": R.mix_to_lora(ev.mix, all_ids),
    }
    if not usage_chunk:
        return [R.sse({**last, **extra}), R.SSE_DONE]
    tail = {k: v for k, v in last.items() if k != "choices"}
    return [R.sse(last), R.sse({**tail, "choices": [], **extra}), R.SSE_DONE]


class _SseOut:
    """Where a stream's SSE bytes go: the client's response and, when the request
    carries an X-Conversation-Id, a resumable session (core/http/streams.py) that
    outlives the client. Without a session a write to a gone client raises
    ConnectionError (the request is cancelled); with one the bytes go on into the
    session and the client is simply no longer written to."""

    def __init__(self, request: web.Request, session: S.StreamSession | None):
        self.request, self.session = request, session
        self.resp: web.StreamResponse | None = None
        self.attached = True

    async def open(self) -> None:
        self.resp = await _open_sse(self.request)

    async def write(self, data: bytes) -> None:
        if self.session is not None:
            self.session.append(data)
        if not self.attached:
            return
        try:
            await self.resp.write(data)
        except ConnectionError:
            if self.session is None:
                raise
            self.detach()

    def detach(self) -> None:
        self.attached = False
        self.request[DISCONNECTED] = True

    def client_gone(self) -> bool:
        """Whether a gone client should cancel the generation (never with a session)."""
        if self.session is not None:
            return False
        t = self.request.transport
        return t is None or t.is_closing()


def _sse_out(request: web.Request) -> _SseOut:
    """The request's output; a new session if it names a conversation (a live one under
    the same id is cancelled, as in llama-server). A bad id is a 400."""
    try:
        cid = S.conversation_id(request.headers)
    except ValueError as e:
        raise HttpError(str(e)) from None
    session = request.app[STREAMS].create_or_replace(cid) if cid is not None else None
    return _SseOut(request, session)


async def _produce(out: _SseOut, body) -> web.StreamResponse:
    """Run a stream's body. With a session it runs as its own task, shielded from the
    handler: when the client goes away aiohttp cancels the handler, and the
    generation goes on into the session (DELETE /v1/stream cancels the task)."""
    if out.session is None:
        await body
        return out.resp
    streams = out.request.app[STREAMS]
    session = out.session

    async def producer():
        try:
            await body
        finally:
            streams.finish(session)

    task = session.task = asyncio.get_running_loop().create_task(producer())
    streams.adopt(task)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # the handler: its client went away
            out.detach()  # the task goes on without it
            raise
        # the producer was stopped (DELETE /v1/stream): this response simply ends
    return out.resp


async def _stream(
    request: web.Request,
    gen,
    token_chunk,
    final_chunks,
    first: dict | None = None,
    progress: Callable[[Any], dict] | None = None,
) -> web.StreamResponse:
    """Write one SSE chunk per event until the request is done. A client that goes
    away cancels the request, which frees its slot in the batch, unless the request
    names a conversation (X-Conversation-Id): then it runs on into its session.
    ``progress`` makes the chunk sent per prompt chunk evaluated (``return_progress``,
    R.progress_chunk)."""
    try:
        out = _sse_out(request)
        await out.open()
    except BaseException:
        gen.cancel()
        raise

    async def body() -> None:
        try:
            if first is not None:
                await out.write(R.sse(first))
            while True:
                ev = await gen.next(watch_client=out.session is None)
                if ev.kind == "progress":
                    if progress is not None:
                        await out.write(R.sse(progress(ev)))
                    continue
                if isinstance(ev, DoneEvent):
                    if ev.stop_type in ("error", "cancel"):
                        await out.write(R.sse(_stream_error(ev)))
                    else:
                        _verbose(request, "content", lambda ev=ev: ev.content)
                        for chunk in final_chunks(ev):
                            await out.write(chunk)
                    break
                chunk = token_chunk(ev)
                if chunk is not None:
                    await out.write(R.sse(chunk))
        except ConnectionError:
            request[DISCONNECTED] = True
        finally:
            gen.cancel()

    return await _produce(out, body())


async def completion(request: web.Request, prompt_field: Any = "prompt") -> web.StreamResponse:
    """llama-server's POST /completion (also /completions, and /infill's answer)."""
    eng, opts, prompt, gen = await _start(request, prompt_field, oai=False)
    if isinstance(gen, list):  # several prompts or n_cmpl > 1
        return await _completion_many(request, eng, opts, prompt, gen)
    mid = _model_id(request, eng)
    tok = eng.tokenizer
    n_probs = opts.params.n_probs
    all_ids = [a["id"] for a in eng.adapters()]

    post = opts.extra["post_sampling"]
    prompt_text = tok.decode(prompt, strip_prefix_space=False)

    def settings_for(done):
        out = R.generation_settings(
            opts.params,
            eng.ctx_size,
            mid,
            opts.stream,
            R.mix_to_lora(done.mix, all_ids),
            eog=eng.tokenizer.eog_ids,
        )
        out["post_sampling_probs"] = post
        return out

    def probability(token, logprob, top, merged):
        e = R.completion_probability(tok, token, logprob, top, merged)
        return R.as_post_sampling(e) if post else e

    def final(done, probs=None, streaming=False):
        """The last object of a /completion answer (the whole body when not streaming)."""
        return R.completion_final(
            done,
            prompt_n=len(prompt),
            model=mid,
            all_ids=all_ids,
            return_tokens=opts.return_tokens,
            probs=probs,
            settings=settings_for(done),
            streaming=streaming,
            prompt_text=prompt_text,
            n_ctx=eng.ctx_size,
        )

    if not opts.stream:
        done, toks = await gen.collect()
        _raise_for_done(done)
        _verbose(request, "content", lambda: done.content)
        probs = None
        if n_probs:
            merger, probs = tok.probs_merger(), []
            for t in toks:
                merged = merger.push(t.token)
                if merged is not None:  # None: ends inside a UTF-8 character
                    probs.append(probability(t.token, t.logprob, t.top, merged))
        out = final(done, probs)
        body = dict(R.select_fields(out, opts.extra["response_fields"]))
        if opts.extra["verbose"]:
            body["__verbose"] = out  # a copy of the whole answer, not itself
        return web.json_response(body)

    merger = tok.probs_merger()

    def token_chunk(ev):
        if ev.kind == "token":
            probs = None
            if n_probs:
                # a token ending inside a UTF-8 character gets no entry (its bytes go
                # into the next one, as in llama-server); its chunk still carries its
                # id and any complete text, so nothing a client counts is lost
                merged = merger.push(ev.token)
                probs = (
                    [] if merged is None else [probability(ev.token, ev.logprob, ev.top, merged)]
                )
            return R.completion_chunk(ev.text, [ev.token], probs, ev.slot)
        if not ev.text:
            return None
        return R.completion_chunk(ev.text, [], [] if n_probs else None, ev.slot)

    def final_chunks(ev):
        return [R.sse(final(ev, streaming=True))]

    base = {
        **R.completion_chunk("", [], None),
        "tokens_predicted": 0,
        "tokens_evaluated": len(prompt),
    }
    progress = R.progress_chunk(base, opts.extra["timings_per_token"])
    return await _stream(request, gen, token_chunk, final_chunks, progress=progress)


async def oai_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/completions."""
    eng, opts, prompt, gen, mid, all_ids, cid, created, n_top = await _start_oai(request, "cmpl")
    tok = eng.tokenizer
    if isinstance(gen, list):  # n > 1 or several prompts: one choice each
        return await _oai_many(request, eng, opts, prompt, gen, (mid, all_ids, cid, created))

    if not opts.stream:
        done, toks = await gen.collect()
        _raise_for_done(done)
        lp = (
            R.oai_completion_logprobs(tok, [(t.token, t.logprob, t.top) for t in toks], n_top)
            if n_top
            else None
        )
        out = R.oai_completion(
            done,
            cid=cid,
            created=created,
            model=mid,
            prompt_n=len(prompt),
            all_ids=all_ids,
            logprobs=lp,
        )
        if opts.extra["verbose"]:
            out["__verbose"] = _verbose_body(eng, opts, prompt, done, mid, all_ids)
        return web.json_response(out)

    def token_chunk(ev):
        lp = (
            R.oai_completion_logprobs(tok, [(ev.token, ev.logprob, ev.top)], n_top)
            if n_top and ev.kind == "token"
            else None
        )
        return (
            R.oai_completion_chunk(ev.text, cid=cid, created=created, model=mid, logprobs=lp)
            if ev.text or lp
            else None
        )

    usage_chunk = opts.extra["include_usage"]

    def final_chunks(ev):
        last = R.oai_completion_chunk(
            "", cid=cid, created=created, model=mid, finish=R.finish_reason(ev.stop_type)
        )
        return _oai_final(last, len(prompt), ev, all_ids, usage_chunk)

    base = R.oai_completion_chunk("", cid=cid, created=created, model=mid)
    progress = R.progress_chunk(base, opts.extra["timings_per_token"])
    return await _stream(request, gen, token_chunk, final_chunks, progress=progress)


def _verbose_body(eng, opts, prompt: list[int], done: DoneEvent, mid: str, all_ids) -> dict:
    """The ``__verbose`` object of an OpenAI answer: the /completion form of the same
    result, with the prompt text the template built."""
    return R.completion_final(
        done,
        prompt_n=len(prompt),
        model=mid,
        all_ids=all_ids,
        return_tokens=False,
        probs=None,
        settings=R.generation_settings(
            opts.params,
            eng.ctx_size,
            mid,
            False,
            R.mix_to_lora(done.mix, all_ids),
            eog=eng.tokenizer.eog_ids,
        ),
        prompt_text=eng.tokenizer.decode(prompt, strip_prefix_space=False),
        n_ctx=eng.ctx_size,
    )


async def chat_input_tokens(request: web.Request) -> web.Response:
    """POST /chat/completions/input_tokens: how many tokens the chat's prompt takes
    (the template rendered as for a generation), without generating."""
    eng = _engine(request)
    body = await _body(request)
    text = await _render_chat(request, eng, body)
    prompt = await _encode_prompt(request, eng, text)
    return web.json_response({"input_tokens": len(prompt)})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/chat/completions, with llama-server's timings and lora extras."""
    eng, opts, prompt, gen, mid, all_ids, cid, created, n_top = await _start_oai(
        request, "chatcmpl", chat=True
    )
    tok = eng.tokenizer
    if isinstance(gen, list):  # n > 1
        meta = (mid, all_ids, cid, created)
        return await _oai_many(request, eng, opts, prompt, gen, meta, chat=True)

    if not opts.stream:
        done, toks = await gen.collect()
        _raise_for_done(done)
        _verbose(request, "content", lambda: done.content)
        lp = (
            [R.oai_chat_logprob(tok, t.token, t.logprob, t.top, n_top) for t in toks]
            if n_top
            else None
        )
        out = R.oai_chat(
            done,
            cid=cid,
            created=created,
            model=mid,
            prompt_n=len(prompt),
            all_ids=all_ids,
            logprobs=lp,
        )
        if opts.extra["verbose"]:  # llama-server's debug copy, in its /completion form
            out["__verbose"] = _verbose_body(eng, opts, prompt, done, mid, all_ids)
        return web.json_response(out)

    def token_chunk(ev):
        lp = (
            [R.oai_chat_logprob(tok, ev.token, ev.logprob, ev.top, n_top)]
            if n_top and ev.kind == "token"
            else None
        )
        return (
            R.oai_chat_chunk({"content": ev.text}, cid=cid, created=created, model=mid, logprobs=lp)
            if ev.text or lp
            else None
        )

    usage_chunk = opts.extra["include_usage"]

    def final_chunks(ev):
        last = R.oai_chat_chunk(
            {}, cid=cid, created=created, model=mid, finish=R.finish_reason(ev.stop_type)
        )
        return _oai_final(last, len(prompt), ev, all_ids, usage_chunk)

    # llama-server's first chunk: the role, and a content that is null (not "")
    first = R.oai_chat_chunk(
        {"role": "assistant", "content": None}, cid=cid, created=created, model=mid
    )
    progress = R.progress_chunk(first, opts.extra["timings_per_token"])
    return await _stream(request, gen, token_chunk, final_chunks, first=first, progress=progress)


# ---- several completions in one request (n > 1, several prompts) ------------------------


async def _collect_all(gens: list[_Generation]) -> list[tuple[DoneEvent, list[TokenEvent]]]:
    """Every generation's result; a failed one fails the request (500, its message), and
    a client that goes away cancels them all."""
    try:
        got = await asyncio.gather(*(g.collect() for g in gens))
    finally:
        for g in gens:
            g.cancel()
    for done, _ in got:
        _raise_for_done(done)
    return got


def _choice_prompt(prompts: list[list[int]], n: int, i: int) -> list[int]:
    return prompts[i // n]


async def _completion_many(request, eng, opts, prompts, gens) -> web.StreamResponse:
    """/completion with several prompts (or n_cmpl > 1): llama-server answers a JSON
    array of results, each with its ``index``; streamed, each chunk carries it."""
    mid = _model_id(request, eng)
    tok = eng.tokenizer
    all_ids = [a["id"] for a in eng.adapters()]
    n = opts.extra["n"]
    post = opts.extra["post_sampling"]

    def final(i: int, done: DoneEvent, probs=None, streaming=False) -> dict:
        prompt = _choice_prompt(prompts, n, i)
        out = R.completion_final(
            done,
            prompt_n=len(prompt),
            prompt_text=tok.decode(prompt, strip_prefix_space=False),
            n_ctx=eng.ctx_size,
            model=mid,
            all_ids=all_ids,
            return_tokens=opts.return_tokens,
            probs=probs,
            settings=R.generation_settings(
                gens[i].req.params,
                eng.ctx_size,
                mid,
                opts.stream,
                R.mix_to_lora(done.mix, all_ids),
                eog=eng.tokenizer.eog_ids,
            ),
            streaming=streaming,
        )
        out["generation_settings"]["post_sampling_probs"] = post
        out["index"] = i
        return out

    def probability(token, logprob, top, merged):
        e = R.completion_probability(tok, token, logprob, top, merged)
        return R.as_post_sampling(e) if post else e

    def probs_of(toks) -> list[dict] | None:
        if not opts.params.n_probs:
            return None
        merger, probs = tok.probs_merger(), []
        for t in toks:
            merged = merger.push(t.token)
            if merged is not None:  # None: ends inside a UTF-8 character
                probs.append(probability(t.token, t.logprob, t.top, merged))
        return probs

    def body(out: dict) -> dict:  # response_fields and verbose, as for one result
        shown = dict(R.select_fields(out, opts.extra["response_fields"]))
        if opts.extra["verbose"]:
            shown["__verbose"] = out
        return shown

    if not opts.stream:
        got = await _collect_all(gens)
        return web.json_response([body(final(i, d, probs_of(t))) for i, (d, t) in enumerate(got)])

    mergers = [tok.probs_merger() for _ in gens]  # one per choice: its own UTF-8 state

    def token_chunk(i: int, ev) -> dict | None:
        if not ev.text and ev.kind != "token":
            return None
        probs = None
        if opts.params.n_probs:  # as the one-result stream (see completion)
            merged = mergers[i].push(ev.token) if ev.kind == "token" else None
            probs = (
                [probability(ev.token, ev.logprob, ev.top, merged)] if merged is not None else []
            )
        out = R.completion_chunk(ev.text, [ev.token] if ev.kind == "token" else [], probs)
        out["index"] = i
        return out

    def final_chunks(i: int, ev) -> list[bytes]:
        return [R.sse(final(i, ev, streaming=True))]

    return await _stream_many(request, gens, token_chunk, final_chunks)


async def _oai_many(request, eng, opts, prompts, gens, meta, chat=False) -> web.StreamResponse:
    """/v1/completions and /v1/chat/completions with n > 1 (or several prompts): one
    choice per generation, ``index`` prompt * n + j; usage adds up all of them."""
    mid, all_ids, cid, created = meta
    tok = eng.tokenizer
    n, n_top = opts.extra["n"], opts.extra["n_top"]
    prompt_n = sum(len(p) for p in prompts)

    def total_usage(dones: list[DoneEvent]) -> dict:
        u = R.usage(prompt_n, dones[0])
        u["completion_tokens"] = sum(len(d.tokens) for d in dones)
        u["total_tokens"] = prompt_n + u["completion_tokens"]
        u["prompt_tokens_details"] = {"cached_tokens": sum(d.timings.cache_n for d in dones)}
        return u

    if not opts.stream:
        got = await _collect_all(gens)
        choices, out = [], {}
        for i, (done, toks) in enumerate(got):
            args = dict(cid=cid, created=created, model=mid, all_ids=all_ids)
            p_n = len(_choice_prompt(prompts, n, i))
            if chat:
                lp = [R.oai_chat_logprob(tok, t.token, t.logprob, t.top, n_top) for t in toks]
                one = R.oai_chat(done, prompt_n=p_n, logprobs=lp if n_top else None, **args)
            else:
                lp = R.oai_completion_logprobs(
                    tok, [(t.token, t.logprob, t.top) for t in toks], n_top
                )
                one = R.oai_completion(done, prompt_n=p_n, logprobs=lp if n_top else None, **args)
            out = out or one
            choices.append({**one["choices"][0], "index": i})
        out["choices"] = choices
        out["usage"] = total_usage([d for d, _ in got])
        return web.json_response(out)

    build = R.oai_chat_chunk if chat else R.oai_completion_chunk

    def chunk(i: int, what, finish=None) -> dict:
        out = build(what, cid=cid, created=created, model=mid, finish=finish)
        out["choices"][0]["index"] = i
        return out

    def token_chunk(i: int, ev) -> dict | None:
        if not ev.text:
            return None
        return chunk(i, {"content": ev.text} if chat else ev.text)

    def final_chunks(i: int, ev) -> list[bytes]:
        return [R.sse(chunk(i, {} if chat else "", R.finish_reason(ev.stop_type)))]

    def closing(dones: list[DoneEvent]) -> list[bytes]:
        tail = {k: v for k, v in chunk(0, {} if chat else "").items() if k != "choices"}
        extra = {"usage": total_usage(dones), "timings": R.timings(dones[0].timings)}
        return [R.sse({**tail, "choices": [], **extra}), R.SSE_DONE]

    def first(i: int) -> dict:
        return chunk(i, {"role": "assistant", "content": None})

    return await _stream_many(
        request, gens, token_chunk, final_chunks, closing, first if chat else None
    )


async def _stream_many(
    request, gens, token_chunk, final_chunks, closing=None, first=None
) -> web.StreamResponse:
    """_stream for several generations at once: their events interleave as the batch
    produces them, each chunk tagged with its choice index by the callbacks. An error
    in any of them ends the stream with the error; a client that goes away cancels all
    (unless the request names a conversation, as in _stream)."""
    try:
        out = _sse_out(request)
        await out.open()
    except BaseException:
        for g in gens:
            g.cancel()
        raise

    async def body() -> None:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g: _Generation) -> None:
            while True:
                ev = await g.next(watch_client=False)
                merged.put_nowait((i, ev))
                if isinstance(ev, DoneEvent):
                    return

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        dones: list[DoneEvent | None] = [None] * len(gens)
        try:
            if first is not None:
                for i in range(len(gens)):
                    await out.write(R.sse(first(i)))
            while any(d is None for d in dones):
                try:
                    i, ev = await asyncio.wait_for(merged.get(), POLL_S)
                except TimeoutError:
                    if out.client_gone():
                        raise ConnectionResetError("client disconnected") from None
                    continue
                if isinstance(ev, DoneEvent):
                    dones[i] = ev
                    if ev.stop_type in ("error", "cancel"):
                        await out.write(R.sse(_stream_error(ev)))
                        break
                    for c in final_chunks(i, ev):
                        await out.write(c)
                    continue
                c = token_chunk(i, ev)
                if c is not None:
                    await out.write(R.sse(c))
            else:
                for c in closing(dones) if closing is not None else []:
                    await out.write(c)
        except ConnectionError:
            request[DISCONNECTED] = True
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                g.cancel()

    return await _produce(out, body())


# ---- resumable streams (llama-server's /v1/stream routes) -------------------------------


def _conv_param(request: web.Request) -> str:
    cid = request.query.get("conv_id", "")
    if not cid:
        raise HttpError("Missing conversation id in path")
    return cid


async def stream_replay(request: web.Request) -> web.StreamResponse:
    """GET /v1/stream?conv_id=…&from=N: the session's SSE bytes from offset N, then the
    live ones until its generation ends (404 when unknown or expired)."""
    cid = _conv_param(request)
    session = request.app[STREAMS].get(cid)
    if session is None:
        raise HttpError("Stream not found or expired", 404, "not_found_error")
    raw = request.query.get("from", "0") or "0"
    if not raw.isdigit() or len(raw) > 18:
        raise HttpError("Invalid 'from' offset")
    offset = int(raw)
    if offset < session.dropped_prefix:
        raise HttpError("Stream offset lost, please restart")
    resp = await _open_sse(request)
    try:
        while True:
            try:
                data = session.read(offset)
            except S.OffsetLost:  # the writer outran this reader past the cap
                break
            if data:
                offset += len(data)
                await resp.write(data)
                continue
            if session.done:
                break
            await session.changed()
    except ConnectionError:
        request[DISCONNECTED] = True
    return resp


async def streams_lookup(request: web.Request) -> web.Response:
    """POST /v1/streams/lookup {"conversation_ids": [...]}: only the ids named."""
    body = await _body(request)
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
    return web.json_response(request.app[STREAMS].lookup(wanted[: S.MAX_SESSIONS]))


async def stream_delete(request: web.Request) -> web.Response:
    """DELETE /v1/stream?conv_id=…: the explicit Stop; 204 even when already gone."""
    request.app[STREAMS].evict_and_cancel(_conv_param(request))
    return web.Response(status=204)
