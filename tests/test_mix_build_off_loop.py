"""A merge method's mix is built off the server's event loop, once.

A ties/dare build takes seconds (4 s on SmolLM2, 27 s on Qwen2.5-0.5B here). It used to
run inside Engine.submit on the asyncio loop thread, so one request naming a new merged
mix froze every other client (and, in the window, the GUI, whose loop it is) until the
build ended; and two requests naming the same new mix built it twice.

Here the build is held at a gate (a wrapper around the real build_mix, deterministic:
no timing): while it is held, /health and a request under another mix must be
answered, and a second request under the same mix must wait for the first build
rather than start its own.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

import core.lora.runtime as runtime
from core.http import ServerSettings, ServerThread
from core.lora.mix import MergedKey
from core.options import EmbeddingOptions, EngineOptions
from core.serve.engine import Engine

HELD_S = 60  # the gate's own bound: a broken build path fails after it, never hangs


@pytest.fixture(scope="module")
def server(smollm_path, ref_dir):
    eng = Engine(
        EngineOptions(
            ctx_size=256, n_parallel=4, embeddings=EmbeddingOptions(enabled=True, pooling="mean")
        )
    )
    eng.load_model(smollm_path)
    for name in ("lora_attn.gguf", "lora_ffn.gguf"):
        eng.add_adapter(ref_dir / "adapters" / name, scale=0.0)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    yield srv
    srv.stop()
    eng.stop()


class Gate:
    """Wraps runtime.build_mix: a merged build waits for release() once entered."""

    def __init__(self, monkeypatch):
        self.entered = threading.Event()
        self.released = threading.Event()
        self.merged_builds: list = []
        self.held = False  # a build is waiting at the gate right now
        real = runtime.build_mix

        def gated(cfg, key, adapters, *rest, **kw):  # rest: progress, control vectors
            if isinstance(key, MergedKey):
                self.merged_builds.append(key)
                self.held = True
                self.entered.set()
                self.released.wait(HELD_S)
                self.held = False
            return real(cfg, key, adapters, *rest, **kw)

        monkeypatch.setattr(runtime, "build_mix", gated)

    def release(self) -> None:
        self.released.set()


def merged(rank: int) -> dict:
    # a rank of its own per test: every test's mix is new to the engine's cache. SVD,
    # the quickest method to build (0.2 s here against dare_ties' 10 s): the gate holds
    # the build, whatever its method
    return {
        "adapters": [{"id": 0, "scale": 0.8}, {"id": 1, "scale": 0.6}],
        "method": "svd",
        "rank": rank,
    }


def completion(lora=None, n: int = 1) -> dict:
    body = {"prompt": "The sea is", "n_predict": 3, "temperature": 0, "n": n}
    return body if lora is None else {**body, "lora": lora}


GRID = {
    "prompt": "The sea is",
    "n_predict": 2,
    "temperature": 0,
    "x": {"kind": "scale", "adapter": 0, "values": [1]},  # one cell: one build
    "y": {"kind": "method", "values": [{"method": "svd", "rank": 44}]},
}

# (route, a body that needs the held build): every path that submits work under a mix
HELD = {
    "completion": ("/completion", completion(merged(11))),
    "n-choices": ("/v1/completions", completion(merged(12), n=2)),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "lora": merged(13)},
    ),
    "embeddings": ("/v1/embeddings", {"input": "The sea is", "lora": merged(14)}),
    "grid": ("/mixdesk/grid", GRID),
}


@pytest.mark.parametrize("route", list(HELD))
def test_a_merge_build_does_not_stop_the_server(server, monkeypatch, route):
    path, body = HELD[route]
    gate = Gate(monkeypatch)

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4 * HELD_S)) as s:

            async def post(p, b):
                async with s.post(server.url + p, json=b) as r:
                    return r.status, await r.json()

            held = [asyncio.ensure_future(post(path, body)) for _ in range(2)]
            assert await asyncio.to_thread(gate.entered.wait, HELD_S), "no build started"
            # the build is held: the loop must still answer, and the engine still serve
            # (ordering, not timing: on the old path these could only answer after
            # the gate gave up, HELD_S later)
            async with s.get(server.url + "/health") as r:
                health = (r.status, gate.held)
            st, out = await post("/completion", completion())
            other = (st, out.get("tokens_predicted"), gate.held)
            still_waiting = not any(t.done() for t in held)
            gate.release()
            return health, other, still_waiting, await asyncio.gather(*held)

    health, other, still_waiting, results = asyncio.run(go())
    assert health == (200, True), "the loop did not answer while the build ran"
    assert other == (200, 3, True), "another mix's request waited for the build"
    assert still_waiting  # both requests under the new mix waited for its build
    for status, out in results:
        assert status == 200, out
    # the second request waited for the first one's build instead of starting its own
    assert len(gate.merged_builds) == 1, gate.merged_builds
