"""HTTP section: the engine's batching gains measured through the real server (#22).

    .venv/bin/python -m bench.http [--quick] [-m MODEL]

Runs alone (loading the model itself) or as a section of ``bench.engine``. Every HTTP
figure is printed next to the in-process figure of the same work, measured right
before it (best of a few, interleaved: this VM's speed drifts between minutes):

* one stream: ``/completion`` streaming over loopback vs ``Engine.generate``;
* 8 streams x 8 mixes (each request its own ``lora`` field), streaming and not, vs
  the same 8 requests submitted in process (callbacks, as bench.engine does);
* A->B->A switch-back time to first token over HTTP, as % of a cold prefill.

The client is aiohttp on this process's main thread; the server runs on its own
thread (core.http.ServerThread), so the client pays its share of the GIL, as any
client on a 2-core machine pays its share of the CPU.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp

from core.http import ServerSettings, ServerThread
from core.serve.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
REPS = 2


def lora_field(mix: dict[int, float]) -> list[dict]:
    return [{"id": aid, "scale": s} for aid, s in mix.items()]


def body(prompt: list[int], n: int, mix: dict[int, float], stream: bool, **kw) -> dict:
    return {
        "prompt": [int(t) for t in prompt],
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": kw.pop("cache_prompt", False),
        "stream": stream,
        "lora": lora_field(mix),
        **kw,
    }


# -- in process --------------------------------------------------------------------------
def inproc_one(eng, prompt: list[int], n: int) -> float:
    """Decode tok/s of one stream, timed where its tokens arrive (first to last)."""
    stamps = []
    for ev in eng.generate(prompt, SamplingParams(n_predict=n, **GREEDY), cache_prompt=False):
        if ev.kind == "token":
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def inproc_many(eng, prompts: list[list[int]], n: int, mixes: list[dict]) -> float:
    """Aggregate tok/s of concurrent requests, submit to last done: bench.engine's
    run_streams (callbacks on the engine thread), its wall-clock figure."""
    from bench.engine import run_streams  # bench.engine imports this module lazily too

    return run_streams(eng, prompts, mixes, n)[0]


# -- over HTTP ------------------------------------------------------------------------------
async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON objects of a server-sent event stream, with their arrival times."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: ") and event[6:] != b"[DONE]":
                yield time.perf_counter(), json.loads(event[6:])


async def http_stream(session, url: str, b: dict) -> tuple[list[float], dict]:
    """POST a streaming /completion: (arrival time of each token chunk, final chunk)."""
    stamps, last = [], {}
    async with session.post(url + "/completion", json=b) as r:
        r.raise_for_status()
        async for t, obj in sse_events(r):
            if obj.get("tokens"):
                stamps.append(t)
            if obj.get("stop"):
                last = obj
    return stamps, last


async def http_plain(session, url: str, b: dict) -> dict:
    async with session.post(url + "/completion", json=b) as r:
        r.raise_for_status()
        return await r.json()


async def http_one(url: str, prompt: list[int], n: int) -> float:
    async with aiohttp.ClientSession() as s:
        stamps, _ = await http_stream(s, url, body(prompt, n, {}, True))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def http_many(
    url: str, prompts: list[list[int]], n: int, mixes: list[dict], stream: bool
) -> tuple[float, list[dict]]:
    """Aggregate tok/s of concurrent /completion requests (first sent to last done),
    and each one's final body (timings, tokens)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        bodies = [body(p, n, m, stream, return_tokens=True) for p, m in zip(prompts, mixes)]
        t = time.perf_counter()
        if stream:
            got = await asyncio.gather(*(http_stream(s, url, b) for b in bodies))
            finals = [last for _, last in got]
        else:
            finals = await asyncio.gather(*(http_plain(s, url, b) for b in bodies))
        dt = time.perf_counter() - t
    return sum(f["timings"]["predicted_n"] for f in finals) / dt, finals


async def http_ttft(url: str, prompt: list[int], mix: dict) -> float:
    async with aiohttp.ClientSession() as s:
        t = time.perf_counter()
        stamps, _ = await http_stream(s, url, body(prompt, 1, mix, True, cache_prompt=True))
    return stamps[0] - t


def extra_steps(eng, fn):
    """fn()'s result, and how many more scheduler steps it took than n tokens need:
    0 when the 8 requests started in one step (prefilled as one batch)."""
    before = eng.scheduler.steps
    out = fn()
    return out, eng.scheduler.steps - before


def run(ctx) -> None:
    eng = ctx.eng
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    try:
        _run(ctx, srv)
    finally:
        srv.stop()


def loop_wakeups(srv) -> int | None:
    """Hand-overs of engine events to the server's loop so far (None: a server
    without the per-step relay, i.e. one wake-up per event)."""
    try:
        from core.http.plumbing import RELAY
    except ImportError:
        return None
    return srv.app[RELAY].wakeups


def _run(ctx, srv) -> None:
    from bench.engine import eight_mixes

    eng, n, prompt, url = ctx.eng, ctx.n_decode, ctx.prompt, srv.url
    short = [int(t) for t in prompt[:16]]
    prompts = [[int(t) for t in prompt[k : k + 16]] for k in range(8)]
    mixes = eight_mixes(ctx.ids)
    if not ctx.ids:
        print("http: no reference adapter fits this model: the 8 mixes are 8 empty mixes")

    # -- one stream ------------------------------------------------------------------------
    one_in = one_http = 0.0
    for _ in range(REPS + 1):
        one_in = max(one_in, inproc_one(eng, short, n))
        one_http = max(one_http, asyncio.run(http_one(url, short, n)))
    print(
        f"http one stream: {one_http:.1f} tok/s vs {one_in:.1f} in process "
        f"= {one_http / one_in:.2f} (target >= 0.95)"
    )

    # -- 8 streams x 8 mixes ----------------------------------------------------------------
    agg_in = agg_sse = agg_json = 0.0
    late = {}  # label -> extra steps: 0 when all 8 started in one step
    wake = {}  # label -> loop wake-ups per step
    for _ in range(REPS):
        v, st = extra_steps(eng, lambda: inproc_many(eng, prompts, n, mixes))
        agg_in, late["in process"] = max(agg_in, v), max(late.get("in process", 0), st - n)
        for label, stream in (("streaming", True), ("non-streaming", False)):
            w0 = loop_wakeups(srv)
            (v, _), st = extra_steps(
                eng, lambda s=stream: asyncio.run(http_many(url, prompts, n, mixes, stream=s))
            )
            late[label] = max(late.get(label, 0), st - n)
            w1 = loop_wakeups(srv)
            # without the relay every event woke the loop: 8 tokens a step, + 8 done
            wake[label] = (w1 - w0) / st if w0 is not None else (8 * n + 8) / st
            if label == "streaming":
                agg_sse = max(agg_sse, v)
            else:
                agg_json = max(agg_json, v)
    for label, v in (("streaming", agg_sse), ("non-streaming", agg_json)):
        print(
            f"http 8 streams x 8 mixes, {label}: {v:.1f} tok/s aggregate = "
            f"{v / agg_in:.2f} of in process ({agg_in:.1f} tok/s alongside; target >= 0.9) "
            f"= {v / one_http:.1f}x one http stream (target >= 2.4x); "
            f"{late[label]} step(s) more than {n} (0: all 8 started in one step; "
            f"in process {late['in process']}); {wake[label]:.2f} loop wake-ups per step"
            + (" (one per event)" if loop_wakeups(srv) is None else "")
        )

    # -- A -> B -> A switch-back -------------------------------------------------------------
    if len(ctx.ids) >= 2:
        mix_a, mix_b = {ctx.ids[0]: 1.0}, {ctx.ids[1]: 1.0}
    else:
        mix_a, mix_b = {}, None
    eng.prefix.clear()
    cold = asyncio.run(http_ttft(url, prompt, mix_a))
    if mix_b is not None:
        asyncio.run(http_ttft(url, prompt, mix_b))
    back = asyncio.run(http_ttft(url, prompt, mix_a))
    print(
        f"http A->B->A: switch-back TTFT {back * 1e3:.0f} ms = {100 * back / cold:.1f}% of "
        f"cold {cold * 1e3:.0f} ms (target <= 5%)"
        + ("" if mix_b is not None else "; no adapters: A->A")
    )


def main() -> None:
    import numpy as np

    from bench.engine import BenchContext, bench_adapters, bench_args
    from core.options import EngineOptions
    from core.serve.engine import Engine

    args, path, n_decode, n_prefill = bench_args()
    eng = Engine(EngineOptions(ctx_size=2048, n_parallel=8, draft_max=0, weights=args.weights))
    eng.load_model(path)
    eng.start()
    tmp = Path(tempfile.mkdtemp(prefix="mixdesk-bench-http-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    ids, labels = bench_adapters(eng, tmp)  # bench.engine's: the model's reference ones
    print(f"model: {path.name}   adapters: {', '.join(labels) or 'none'}")
    rng = np.random.default_rng(0)
    prompt = [1] + [
        int(t) for t in rng.integers(100, min(40000, eng.config.vocab_size), n_prefill - 1)
    ]
    try:
        run(BenchContext(eng, path, args, ids, prompt, n_decode, n_prefill))
    finally:
        eng.stop()


if __name__ == "__main__":
    main()
