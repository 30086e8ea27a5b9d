"""What every route shares: the app's state, bounded pools, reading a request, and
running a generation to its answer (JSON or server-sent events).

Generation never blocks the event loop: requests go to the engine's scheduler
thread, whose events come back through ``loop.call_soon_threadsafe`` into an
asyncio.Queue (:class:`Generation`). A client that goes away cancels its request,
which frees its slot, unless it named a conversation (``X-Conversation-Id``): then
the stream runs on into a resumable session (core/http/streams.py).

Other blocking work a client can trigger (loading an adapter, rendering a chat
template, tokenizing a long text, building a merged mix) runs on a
:class:`BlockingPool` of its own kind: a few daemon threads, a short bounded queue
(beyond it: 503, busy) and a time limit per call, so no client can tie up a shared
executor or the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..chat_template import build_prompt
from ..errors import HttpError
from ..serve.relay import LoopRelay
from ..serve.sampling import SamplingParams
from ..serve.scheduler import DoneEvent, TokenEvent
from . import endpoints as E
from . import parsing as P
from . import responses as R
from . import streams as S
from .security import DISCONNECTED, printable

if TYPE_CHECKING:
    from .app import ServerSettings

log = logging.getLogger("mixdesk.http")


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
            fut.add_done_callback(self._unheard)
            raise self._busy(f"{self.kind} took longer than {self.timeout:g} s") from None
        except asyncio.CancelledError:  # the handler's client went away
            fut.add_done_callback(self._unheard)
            raise

    def _unheard(self, fut: asyncio.Future) -> None:
        """The outcome of a call its handler stopped waiting for. Read here, or asyncio
        logs "exception was never retrieved" whenever the future happens to be
        collected, from inside whatever runs then (in 3.11 that log parses source with
        ``ast``, and broke an ``ast.parse`` it interrupted)."""
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("%s call failed after its handler left: %r", self.kind, fut.exception())


class EngineBox:
    """Mutable holder: the app's state must not change once it runs, the engine may."""

    def __init__(self, engine):
        self.engine = engine

    def model_info(self) -> dict:
        return self.engine.model_info()


# the app's state, one key each (aiohttp's typed app keys)
ENGINE = web.AppKey("engine", EngineBox)
SETTINGS: web.AppKey[ServerSettings] = web.AppKey("settings")  # the class is app.py's
REQUEST_LOG = web.AppKey("request_log", Callable[[str], None])  # one line per request
LOAD_LOCK = web.AppKey("load_lock", asyncio.Lock)
ADAPTER_POOL = web.AppKey("adapter_pool", BlockingPool)
TEXT_POOL = web.AppKey("text_pool", BlockingPool)
MIX_POOL = web.AppKey("mix_pool", BlockingPool)
TRAIN_POOL = web.AppKey("train_pool", BlockingPool)  # POST /control-vectors/train
METRICS = web.AppKey("metrics", E.Metrics)
RELAY = web.AppKey("relay", LoopRelay)  # engine events to this app's loop, once per step
STREAMS = web.AppKey("streams", S.StreamSessions)  # resumable streams by X-Conversation-Id

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
TOKENIZE_INLINE_CHARS = 16384  # longer texts are tokenized on the text pool


def get_engine(request: web.Request):
    eng = request.app[ENGINE].engine
    if eng is None or not eng.ready:
        loading = eng is None or eng.loading
        raise HttpError("Loading model" if loading else "no model loaded", 503, "unavailable_error")
    return eng


def get_settings(request: web.Request) -> ServerSettings:
    return request.app[SETTINGS]


async def read_body(request: web.Request) -> bytes:
    """The body, which must arrive within body_timeout (a client trickling its body
    byte by byte cannot hold a handler forever)."""
    timeout = get_settings(request).body_timeout
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise HttpError(
            f"the request body did not arrive within {timeout:g} s", 408, "invalid_request_error"
        ) from None


async def json_body(request: web.Request) -> dict:
    return P.parse_json_body(await read_body(request))


def adapter_ids(eng) -> list[int]:
    """The ids of the engine's adapters, in order."""
    return [a["id"] for a in eng.adapters()]


def model_id(request: web.Request, eng) -> str:
    s = get_settings(request)
    return s.alias or (Path(eng.path).name if eng.path else "mixdesk")


def log_verbose(request: web.Request, what: str, text: Callable[[], str]) -> None:
    """--verbose logging; ``text`` is only computed when it is logged."""
    if get_settings(request).verbose:
        log.info("%s %s: %r", printable(request.path), what, text())


async def encode_prompt(request: web.Request, eng, prompt: Any) -> list[int]:
    size = (
        len(prompt)
        if isinstance(prompt, str)
        else sum(len(x) for x in prompt if isinstance(x, str))
        if isinstance(prompt, list)
        else 0
    )
    if size > TOKENIZE_INLINE_CHARS:
        ids = await request.app[TEXT_POOL].run(P.parse_prompt, prompt, eng.tokenizer)
    else:
        ids = P.parse_prompt(prompt, eng.tokenizer)
    P.check_prompt_tokens(ids, eng.config.vocab_size)
    return ids


async def render_chat(request: web.Request, eng, body: dict) -> str:
    """The prompt text llama-server builds for a chat request (build_prompt, the one
    prompt path the window shares), off the event loop and under the render limits."""
    msgs = P.parse_messages(body)
    opts = P.parse_chat_options(body)
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


async def mixes_ready(request: web.Request, eng, mixes: list) -> None:
    """Build, on the mix-build pool's thread, any of these mixes (None: the global mix)
    that is not built yet, so that the submit that follows finds them built. A merge
    method's build takes seconds (27 s for ties on Qwen2.5-0.5B): run inside the
    submit, on this loop, it stopped every other client (and, in the window, the GUI)
    until it ended."""
    if not eng.mixes_built(mixes):
        await request.app[MIX_POOL].run(eng.prepare_mixes, mixes)


def refused(e: BaseException, prompt: list[int], eng) -> BaseException:
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


_CLIENT_GONE = object()  # queued by Generation._watch: the client went away


class Generation:
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
            raise refused(e, prompt, eng) from None

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
            raise refused(bad[0][0], bad[0][1], eng)
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


async def open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


def raise_for_done(done: DoneEvent) -> None:
    if done.stop_type == "error":
        raise HttpError(done.error or "generation failed", 500, done.error_type or "server_error")
    if done.stop_type == "cancel":
        raise HttpError(
            "the request was cancelled (server shutting down)", 503, "unavailable_error"
        )


def stream_error(done: DoneEvent) -> dict:
    if done.stop_type == "error":
        return R.error_body(
            done.error or "generation failed", 500, done.error_type or "server_error"
        )
    return R.error_body("the request was cancelled", 503, "unavailable_error")


class SseOut:
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
        self.resp = await open_sse(self.request)

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


def sse_out(request: web.Request) -> SseOut:
    """The request's output; a new session if it names a conversation (a live one under
    the same id is cancelled, as in llama-server). A bad id is a 400."""
    try:
        cid = S.conversation_id(request.headers)
    except ValueError as e:
        raise HttpError(str(e)) from None
    session = request.app[STREAMS].create_or_replace(cid) if cid is not None else None
    return SseOut(request, session)


async def produce(out: SseOut, body) -> web.StreamResponse:
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


async def stream_events(
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
        out = sse_out(request)
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
                        await out.write(R.sse(stream_error(ev)))
                    else:
                        log_verbose(request, "content", lambda ev=ev: ev.content)
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

    return await produce(out, body())


async def stream_many(
    request, gens, token_chunk, final_chunks, closing=None, first=None
) -> web.StreamResponse:
    """stream_events for several generations at once: their events interleave as the batch
    produces them, each chunk tagged with its choice index by the callbacks. An error
    in any of them ends the stream with the error; a client that goes away cancels all
    (unless the request names a conversation, as in stream_events)."""
    try:
        out = sse_out(request)
        await out.open()
    except BaseException:
        for g in gens:
            g.cancel()
        raise

    async def body() -> None:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g: Generation) -> None:
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
                        await out.write(R.sse(stream_error(ev)))
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

    return await produce(out, body())


async def collect_all(gens: list[Generation]) -> list[tuple[DoneEvent, list[TokenEvent]]]:
    """Every generation's result; a failed one fails the request (500, its message), and
    a client that goes away cancels them all."""
    try:
        got = await asyncio.gather(*(g.collect() for g in gens))
    finally:
        for g in gens:
            g.cancel()
    for done, _ in got:
        raise_for_done(done)
    return got


def choice_prompt(prompts: list[list[int]], n: int, i: int) -> list[int]:
    return prompts[i // n]
