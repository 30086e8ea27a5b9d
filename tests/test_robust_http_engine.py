"""Issue #15 through the real HTTP server (127.0.0.1, aiohttp client, real SmolLM2):
hostile sampling values and LoRA scales answer 400 naming the field, a request whose
numbers overflow fails alone with a 500, the next normal completion answers the same
text as before, and /health answers 503 with the reason when nothing would be served."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine
from tests.test_robust_engine import write_hostile_adapter


@pytest.fixture(scope="module")
def server(smollm_path, ref_dir, tmp_path_factory):
    eng = Engine(EngineOptions(ctx_size=256, n_parallel=2))
    eng.load_model(smollm_path)
    eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=0.0)
    hostile = write_hostile_adapter(tmp_path_factory.mktemp("hostile") / "h.gguf", eng.config)
    eng.hostile = eng.add_adapter(hostile, scale=0.0)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, lora_init_without_apply=True)).start()
    srv.eng = eng
    yield srv
    srv.stop()
    eng.stop()


def req(srv, method, path, body=None):
    async def go():
        async with aiohttp.ClientSession() as s:
            data = json.dumps(body) if body is not None else None
            async with s.request(method, srv.url + path, data=data) as r:
                return r.status, json.loads(await r.text())

    return asyncio.run(go())


NORMAL = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def normal_text(server):
    status, body = req(server, "POST", "/completion", NORMAL)
    assert status == 200, body
    return body["content"]


def assert_still_serving(server, normal_text):
    status, body = req(server, "POST", "/completion", NORMAL)
    assert status == 200 and body["content"] == normal_text
    assert req(server, "GET", "/health") == (200, {"status": "ok"})


def assert_400(status, body, field):
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and field in body["error"]["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("frequency_penalty", -1e300),
        ("frequency_penalty", 1e300),
        ("presence_penalty", 1e300),
        ("repeat_penalty", 1e-300),
    ],
)
def test_overflowing_penalties_answer_400_and_the_engine_keeps_serving(
    server, normal_text, field, value
):
    """The curl repro of issue #15: the request used to kill the scheduler thread, and
    every later completion never answered."""
    body = {"prompt": "Hi", "n_predict": 4, "temperature": 1, field: value}
    assert_400(*req(server, "POST", "/completion", body), field)
    assert_still_serving(server, normal_text)


def test_overflowing_lora_scales_answer_400(server, normal_text):
    before = req(server, "GET", "/lora-adapters")
    status, body = req(server, "POST", "/lora-adapters", [{"id": 0, "scale": 1e308}])
    assert_400(status, body, "scale of adapter 0")
    assert req(server, "GET", "/lora-adapters") == before  # the global mix is unchanged
    body = dict(NORMAL, lora=[{"id": 0, "scale": 1e20}])
    assert_400(*req(server, "POST", "/completion", body), "lora: scale of adapter 0")
    assert_still_serving(server, normal_text)


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_a_request_whose_activations_overflow_fails_alone_with_500(server, normal_text, path):
    lora = [{"id": server.eng.hostile, "scale": 1.0}]
    if path == "/completion":
        body = dict(NORMAL, lora=lora)
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "lora": lora}
    status, got = req(server, "POST", path, body)
    assert status == 500, got
    assert got["error"]["type"] == "server_error" and "not finite" in got["error"]["message"]
    assert_still_serving(server, normal_text)


def test_health_is_503_with_the_reason_when_the_engine_loop_is_not_running(server):
    assert req(server, "GET", "/health") == (200, {"status": "ok"})
    server.eng.stop()
    try:
        status, body = req(server, "GET", "/health")
        assert status == 503, body
        assert body["error"]["type"] == "unavailable_error"
        assert "not running" in body["error"]["message"]
    finally:
        server.eng.start()
    for _ in range(500):
        if req(server, "GET", "/health")[0] == 200:
            break
    assert req(server, "GET", "/health") == (200, {"status": "ok"})
