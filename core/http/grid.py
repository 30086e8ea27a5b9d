"""POST /mixdesk/grid: the X/Y grid of mixes (core/grid.py) over HTTP (issue #21).

Body: the prompt (``"messages"`` for chat, or ``"prompt"`` raw text), llama-server's
sampling fields (``n_predict``, ``temperature``, ``seed``, ...), an ``"x"`` axis, an
optional ``"y"`` axis (each ``{"kind": "scale" | "preset" | "method" | "seed",
"values": [...]}``, a scale axis with its ``"adapter"`` id or name), optional
``"presets"`` (named mixes for a preset axis), an optional ``"lora"`` base mix and
``"stream"``::

    {"messages": [{"role": "user", "content": "Hi"}], "n_predict": 16, "temperature": 0,
     "x": {"kind": "scale", "adapter": 0, "values": [0, 0.5, 1]},
     "y": {"kind": "seed", "values": [1, 2]}}

Answer: ``{"columns", "rows", "x", "y", "prompt_n", "cells": [...]}``, one cell per
X × Y combination (row-major) with its mix, reply, tokens, tok/s and stop reason.
With ``"stream": true``: server-sent events ``{"cell": i, "content": "..."}`` as the
batch produces tokens, ``{"cell": i, "done": true, ...the cell...}`` as each cell
ends, then ``[DONE]``. The same API key, Host check, body limit and error format as
every route (the middlewares); a client that goes away cancels every cell.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .. import grid as G
from ..serve.scheduler import DoneEvent
from . import parsing as P
from . import responses as R
from .plumbing import (
    METRICS,
    POLL_S,
    RELAY,
    encode_prompt,
    get_engine,
    get_settings,
    json_body,
    mixes_ready,
    open_sse,
    raise_for_done,
    refused,
    render_chat,
    stream_error,
)
from .security import DISCONNECTED


def _axis_json(axis: G.Axis | None, names: dict[int, str]) -> dict | None:
    if axis is None:
        return None
    values = [v.as_dict() for v in axis.values] if axis.kind == "method" else list(axis.values)
    out = {"kind": axis.kind, "values": values}
    if axis.adapter is not None:
        out["adapter"] = axis.adapter
    out["labels"] = [axis.label(i, names) for i in range(len(axis.values))]
    return out


async def grid(request: web.Request) -> web.StreamResponse:
    eng = get_engine(request)
    s = get_settings(request)
    body = await json_body(request)
    params = P.parse_sampling(body, s.n_predict_default, False, s.sampling)
    stream = P.get_bool(body, "stream", False)
    cache_prompt = P.get_bool(body, "cache_prompt", True)
    names = {a["id"]: a["name"] for a in eng.adapters()}
    spec = G.parse_spec(body, params, names)  # GridError (a UserError): 400
    if spec.messages is not None:
        prompt = await encode_prompt(request, eng, await render_chat(request, eng, body))
    else:
        prompt = await encode_prompt(request, eng, spec.prompt)
    cells = G.cells(spec, eng.get_mix(), names)

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def lost() -> None:  # the loop is gone (server stopped): stop generating
        if run is not None:
            run.cancel()

    # every cell's events of one step reach this loop in one wake-up (#22)
    relay = request.app[RELAY]
    relay.bind(loop)
    send = relay.sender(events.put_nowait, lost)

    def on_event(i: int, ev) -> None:  # the engine thread
        send((i, ev))

    await mixes_ready(request, eng, [c.mix for c in cells])  # a method axis builds off the loop
    run = None
    try:
        run = G.submit_grid(eng, cells, prompt, on_event, source="http", cache_prompt=cache_prompt)
    except Exception as e:
        raise refused(e, prompt, eng) from None

    def client_gone() -> bool:
        t = request.transport
        return t is None or t.is_closing()

    async def next_event():
        """The next (cell, event); a client that went away cancels every cell."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), POLL_S)
            except TimeoutError:
                if client_gone():
                    request[DISCONNECTED] = True
                    raise ConnectionResetError("client disconnected") from None

    dones: dict[int, DoneEvent] = {}

    def finish(i: int, ev: DoneEvent) -> dict:
        dones[i] = ev
        if ev.stop_type not in ("error", "cancel"):
            request.app[METRICS].record(ev)
        return G.CellResult.from_done(cells[i], ev).as_dict(names)

    head = {
        "columns": spec.shape[0],
        "rows": spec.shape[1],
        "x": _axis_json(spec.x, names),
        "y": _axis_json(spec.y, names),
        "prompt_n": len(prompt),
    }
    if not stream:
        try:
            out: list[dict | None] = [None] * len(cells)
            while len(dones) < len(cells):
                i, ev = await next_event()
                if isinstance(ev, DoneEvent):
                    raise_for_done(ev)  # a failed cell fails the grid (500, its message)
                    out[i] = finish(i, ev)
        finally:
            run.cancel()  # no-op for finished cells
        return web.json_response({**head, "cells": out})

    resp = await open_sse(request)
    try:
        await resp.write(R.sse({"grid": head}))
        while len(dones) < len(cells):
            i, ev = await next_event()
            if isinstance(ev, DoneEvent):
                if ev.stop_type in ("error", "cancel"):
                    await resp.write(R.sse({"cell": i, **stream_error(ev)}))
                    break
                await resp.write(R.sse({"cell": i, "done": True, **finish(i, ev)}))
            elif ev.kind == "token" and ev.text:
                await resp.write(R.sse({"cell": i, "content": ev.text}))
        else:
            await resp.write(R.SSE_DONE)
    except ConnectionError:
        request[DISCONNECTED] = True
    finally:
        run.cancel()
    return resp
