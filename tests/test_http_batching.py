"""Concurrent HTTP requests run as one batch, and each step reaches every client with one
wake-up of the server's event loop (#22). Real SmolLM2, the llama.cpp reference adapters,
a real server on 127.0.0.1 and a real aiohttp client; no timing is asserted (speed lives
in bench/http.py): step numbers, wake-up counters and tokens are.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from core.http.plumbing import RELAY
from core.serve.engine import Engine
from core.serve.relay import LoopRelay, step_events
from tests.serving import running_engine, serving

N = 8  # concurrent requests, each its own mix
N_PREDICT = 8
ADAPTERS = ["lora_attn.gguf", "lora_ffn.gguf", "lora_all_q8.gguf"]
# bench.engine's 8 mixes: none, then one adapter at a time at these scales
MIXES = [[]] + [[{"id": i % 3, "scale": s}] for i, s in enumerate((0.5, 1, -0.5, 1.5, 0.25, -1, 2))]
WAIT_S = 120


@pytest.fixture(scope="module")
def server(smollm_path, ref_dir):
    adapters = [ref_dir / "adapters" / name for name in ADAPTERS]
    with running_engine(
        smollm_path, adapters=adapters, ctx_size=128, n_parallel=N, draft_max=0
    ) as eng:
        with serving(eng) as srv:
            srv.eng = eng
            yield srv


def body(k: int, stream: bool) -> dict:
    return {
        "prompt": [1, 504 + 37 * k, 9050, 28, 314 + k],  # 8 different short prompts
        "n_predict": N_PREDICT,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": stream,
        "lora": MIXES[k],
    }


async def post(session, url: str, b: dict) -> list[int]:
    """The generated token ids of one /completion (streamed or not)."""
    async with session.post(url + "/completion", data=json.dumps(b)) as r:
        assert r.status == 200, await r.text()
        if not b["stream"]:
            return (await r.json())["tokens"]
        toks, buf = [], b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                toks += json.loads(event.removeprefix(b"data: "))["tokens"]
        return toks


class Held:
    """The engine thread held between two steps (Engine.run_on_engine) until every one
    of ``n`` requests has been queued, so that they are all waiting when it steps."""

    def __init__(self, eng: Engine, n: int):
        self.queued, self.running, self.release = (threading.Event() for _ in range(3))
        seen: list[int] = []

        def on(name: str, payload: dict) -> None:
            if name == "request_started":  # sent once the request is in the queue
                seen.append(payload["id"])
                if len(seen) == n:
                    self.queued.set()

        self.unsubscribe = eng.subscribe(on)
        self.call = eng.run_on_engine(lambda model: (self.running.set(), self.release.wait(WAIT_S)))
        assert self.running.wait(WAIT_S)

    async def go(self) -> None:
        assert await asyncio.to_thread(self.queued.wait, WAIT_S)
        self.release.set()
        self.unsubscribe()


def run_together(srv, stream: bool) -> tuple[list[list[int]], int, int, int]:
    """N different-mix requests sent together: (tokens of each, scheduler steps taken,
    loop wake-ups, events delivered)."""
    eng, relay = srv.eng, srv.app[RELAY]

    async def main():
        held = Held(eng, N)
        steps, wakeups, delivered = eng.scheduler.steps, relay.wakeups, relay.delivered
        async with aiohttp.ClientSession() as s:
            sent = [asyncio.ensure_future(post(s, srv.url, body(k, stream))) for k in range(N)]
            await held.go()
            toks = await asyncio.gather(*sent)
        return (
            toks,
            eng.scheduler.steps - steps,
            relay.wakeups - wakeups,
            relay.delivered - delivered,
        )

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_requests_queued_together_start_in_one_step_and_wake_the_loop_once_per_step(server, stream):
    toks, steps, wakeups, delivered = run_together(server, stream)
    assert [len(t) for t in toks] == [N_PREDICT] * N
    # all 8 prefilled in one step and decoded side by side: N_PREDICT steps in all,
    # where one request admitted a step late would have made it N_PREDICT + 1
    assert steps == N_PREDICT
    # every step's tokens (and the last step's done events) reached all 8 requests in
    # one hand-over to the loop: 8 wake-ups, not 8 per step
    assert wakeups == steps
    assert delivered >= N * (N_PREDICT + 1)  # a token per step each, and a done each


def test_eight_concurrent_different_mix_streams_equal_each_run_alone(server):
    together, _, _, _ = run_together(server, stream=True)

    async def alone():
        async with aiohttp.ClientSession() as s:
            return [await post(s, server.url, body(k, True)) for k in range(N)]

    alone_toks = asyncio.run(alone())
    assert together == alone_toks
    assert len({tuple(t) for t in alone_toks}) > 1  # the mixes (and prompts) do differ


def test_a_relay_hands_a_steps_events_over_in_one_wake_up_in_order():
    loop = asyncio.new_event_loop()
    try:
        relay = LoopRelay(loop)
        got: dict[str, list] = {"a": [], "b": []}
        to_a, to_b = relay.sender(got["a"].append), relay.sender(got["b"].append)
        with step_events():
            for i in range(3):
                to_a(i)
                to_b(10 + i)
            assert relay.wakeups == 0  # nothing goes out before the step ends
        assert (relay.wakeups, relay.delivered) == (1, 6)
        to_a(99)  # outside a step (e.g. a test driving Scheduler.step): at once
        assert relay.wakeups == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert got == {"a": [0, 1, 2, 99], "b": [10, 11, 12]}
    finally:
        loop.close()


def test_a_relay_whose_loop_is_gone_cancels_instead_of_delivering():
    loop = asyncio.new_event_loop()
    loop.close()
    lost: list[str] = []
    relay = LoopRelay(loop)
    send = relay.sender(
        lambda ev: pytest.fail("delivered on a closed loop"), lambda: lost.append("x")
    )
    with step_events():
        send("token")
        send("done")
    assert lost == ["x", "x"] and relay.wakeups == 0
