"""Each mixer strip lights while a request that uses its adapter runs, whether the
request came from the chat or over HTTP (both reach the engine's request events)."""

from __future__ import annotations

import threading

from core.serve.sampling import SamplingParams


def test_a_strip_lights_while_an_http_request_uses_its_adapter(loaded, qtbot):
    w = loaded
    attn, ffn = w.ids["lora_attn"], w.ids["lora_ffn"]
    busy = lambda aid: bool(w.mixer.strips[aid].name.property("busy"))  # noqa: E731
    first = threading.Event()

    def on_event(ev):  # scheduler thread
        first.set()

    # what the HTTP API does for a request with "lora": [{"id": attn, "scale": 1}]
    req = w.engine.submit(
        [1, 2, 3, 4],
        SamplingParams(temperature=0.0, n_predict=400),
        on_event,
        mix={attn: 1.0, ffn: 0.0},
        source="http",
    )
    qtbot.waitUntil(lambda: busy(attn), timeout=10000)
    assert not busy(ffn)  # in the request's mix at 0: not used
    assert not busy(w.ids["lora_all_q8"])
    req.cancel()
    qtbot.waitUntil(lambda: not busy(attn), timeout=30000)


def test_a_chat_reply_lights_the_strips_of_the_mix_it_uses(loaded, qtbot, greedy):
    w = loaded
    q8 = w.ids["lora_all_q8"]
    w.mixer.strips[q8].set_value(0.5)
    greedy(w, n_predict=3)
    lit = []
    w.bridge.request_started.connect(
        lambda _: lit.append(bool(w.mixer.strips[q8].name.property("busy")))
    )
    assert w.chat.send("hi")
    qtbot.waitUntil(lambda: not w.chat.generating, timeout=60000)
    assert lit == [True]
    assert not w.mixer.strips[q8].name.property("busy")
