"""llama-server's service endpoints on a real server (127.0.0.1): /slots, /metrics,
/infill, each behind the API key like every route, and 501 when switched off."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from gguf import GGUFValueType
from test_http_api import req, run
from tiny_gguf import write_tiny_llama

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    eng = Engine(EngineOptions(ctx_size=256, n_parallel=2))
    eng.load_model(smollm_path)
    eng.start()
    settings = ServerSettings(
        port=0,
        api_keys=[KEY],
        metrics=True,
        slot_save_path=tmp_path_factory.mktemp("slots"),
    )
    srv = ServerThread(eng, settings).start()
    yield srv
    srv.stop()
    eng.stop()


def parse_metrics(text: str) -> dict:
    out, kinds = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split()
            out[name] = (kinds[name], float(value))
    return out


def test_routes_need_the_api_key(server):
    for method, path in (("GET", "/slots"), ("GET", "/metrics"), ("POST", "/infill")):
        st, out = req(server, method, path, {})
        assert st == 401, path


def test_slots_list_every_slot(server):
    st, slots = req(server, "GET", "/slots", headers=AUTH)
    assert st == 200 and [s["id"] for s in slots] == [0, 1]
    s = slots[0]
    assert s["n_ctx"] == 256 and s["is_processing"] is False
    # llama-server's shape: no "params"; a slot that has run nothing has no task fields
    assert "params" not in s and "next_token" not in s
    st, _ = req(server, "GET", "/slots?fail_on_no_slot=1", headers=AUTH)
    assert st == 200  # idle slots: no failure


def test_fail_on_no_slot_while_every_slot_is_busy(server):
    async def go():
        long = {"prompt": "Once", "n_predict": 200, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=AUTH) as s:
            tasks = [
                asyncio.create_task(s.post(server.url + "/completion", json=long)) for _ in range(2)
            ]
            try:
                for _ in range(200):  # wait until both are generating
                    async with s.get(server.url + "/slots") as r:
                        busy = [x["is_processing"] for x in await r.json()]
                    if all(busy):
                        break
                    await asyncio.sleep(0.05)
                async with s.get(server.url + "/slots?fail_on_no_slot=1") as r:
                    return busy, r.status, await r.json()
            finally:
                for t in tasks:
                    t.cancel()

    busy, st, out = run(go())
    assert busy == [True, True]
    assert st == 503 and out["error"]["message"] == "no slot available"


def test_slot_actions(server):
    req(server, "POST", "/completion", {"prompt": "cache me", "n_predict": 1}, headers=AUTH)
    st, out = req(server, "POST", "/slots/0?action=erase", headers=AUTH)
    assert st == 200 and out["id_slot"] == 0 and out["n_erased"] >= 1
    st, out = req(server, "POST", "/slots/0?action=save", {"filename": "x"}, headers=AUTH)
    assert st == 200 and out["filename"] == "x"  # round trips: tests/test_slots.py
    for path in ("/slots/9?action=erase", "/slots/x?action=erase", "/slots/0?action=zap"):
        st, out = req(server, "POST", path, headers=AUTH)
        assert st == 400, path


def test_metrics_count_the_requests(server):
    n = 0
    for n_predict in (1, 4):
        st, out = req(
            server,
            "POST",
            "/completion",
            {"prompt": "I believe", "n_predict": n_predict, "ignore_eos": True},
            headers=AUTH,
        )
        n += out["timings"]["predicted_n"]

    async def get_metrics():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.get(server.url + "/metrics") as r:
                return r.status, await r.text(), r.headers

    st, text, headers = run(get_metrics())
    assert st == 200
    assert 0 < int(headers["Process-Start-Time-Unix"]) <= time.time()
    m = parse_metrics(text)
    for name in (
        "prompt_tokens_total",
        "prompt_tokens_cached_total",
        "prompt_seconds_total",
        "tokens_predicted_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
        "n_tokens_max",
    ):
        assert m[f"llamacpp:{name}"][0] == "counter"
    for name in ("prompt_tokens_seconds", "requests_processing", "requests_deferred"):
        assert m[f"llamacpp:{name}"][0] == "gauge"
    assert m["llamacpp:tokens_predicted_total"][1] >= n
    assert m["llamacpp:n_decode_total"][1] > 0
    assert m["llamacpp:requests_processing"][1] == 0


def test_infill_without_fim_tokens_is_501(server):
    st, out = req(
        server, "POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")"}, headers=AUTH
    )
    assert st == 501 and "Infill is not supported by this model" in out["error"]["message"]


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fim") / "fim.gguf"
    ids = {"fim_pre": 296, "fim_suf": 297, "fim_mid": 298}
    write_tiny_llama(
        path,
        kv={f"tokenizer.ggml.{k}_token_id": (v, GGUFValueType.UINT32) for k, v in ids.items()},
    )
    eng = Engine(EngineOptions(ctx_size=128, n_parallel=1))
    eng.load_model(path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    yield srv
    srv.stop()
    eng.stop()


def test_infill_builds_the_fim_prompt(fim_server):
    body = {
        "input_prefix": "ab",
        "input_suffix": "cd",
        "prompt": "e",
        "n_predict": 2,
        "ignore_eos": True,
        "return_tokens": True,
    }
    st, out = req(fim_server, "POST", "/infill", body)
    assert st == 200 and out["tokens_predicted"] == 2
    tok = fim_server.engine.tokenizer
    enc = lambda t: tok.encode(t, add_special=False, parse_special=False)  # noqa: E731
    # llama-server's format_prompt_infill: the prompt ends the prefix, FIM_MID comes last
    want = [tok.bos_id, 296, *enc("ab"), *enc("e"), 297, *enc("cd"), 298]
    assert out["tokens_evaluated"] == len(want)
    assert out["prompt"] == tok.decode(want, strip_prefix_space=False)
    st, out = req(fim_server, "POST", "/infill", {"input_extra": "x"})
    assert st == 400 and "input_extra" in out["error"]["message"]
    st, out = req(fim_server, "POST", "/infill", {"input_prefix": 3})
    assert st == 400 and "input_prefix" in out["error"]["message"]


def test_no_slots_answers_501(smollm_path):
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, slots=False)).start()
    try:
        st, out = req(srv, "GET", "/slots")
        assert st == 501 and "--slots" in out["error"]["message"]
    finally:
        srv.stop()
        eng.stop()
