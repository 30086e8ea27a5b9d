"""The HTTP API against a real server (127.0.0.1, free port) with the real SmolLM2 and the
llama.cpp reference adapters, driven by a real HTTP client (aiohttp) and the openai client.

One server for the module. Adapters 0, 1, 2 are lora_attn, lora_ffn, lora_all_q8, loaded
as with --lora-init-without-apply (global scales 0). Tests that change the global mix
put it back. Runtime adapter loading is on (--allow-runtime-lora) with the reference data
folder as the only adapter folder (--lora-dir).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

CTX = 256
ADAPTERS = ["lora_attn.gguf", "lora_ffn.gguf", "lora_all_q8.gguf"]


@pytest.fixture(scope="module")
def server(smollm_path, ref_dir):
    eng = Engine(EngineOptions(ctx_size=CTX, n_parallel=4))
    eng.load_model(smollm_path)
    for name in ADAPTERS:
        eng.add_adapter(ref_dir / "adapters" / name, scale=0.0)
    eng.start()
    lines: list[str] = []
    settings = ServerSettings(
        port=0,
        lora_init_without_apply=True,
        on_log=lines.append,
        allow_runtime_lora=True,
        lora_dirs=[ref_dir],
    )
    srv = ServerThread(eng, settings).start()
    srv.lines = lines
    yield srv
    srv.stop()
    eng.stop()


@pytest.fixture()
def greedy(reference):
    return reference["greedy"]


def run(coro):
    return asyncio.run(coro)


async def call(srv, method, path, body=None, raw: bytes | None = None, **kw):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        async with s.request(method, srv.url + path, data=data, **kw) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def req(srv, method, path, body=None, **kw):
    return run(call(srv, method, path, body, **kw))


def greedy_body(case, n, **extra):
    return {
        "prompt": case["prompt_tokens"],
        "n_predict": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        **extra,
    }


def assert_400(status, body):
    assert status == 400, body
    assert set(body["error"]) >= {"code", "message", "type"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400


def global_scales(srv):
    return [a["scale"] for a in req(srv, "GET", "/lora-adapters")[1]]


# ---- simple endpoints ---------------------------------------------------------------


def test_health_props_models(server):
    assert req(server, "GET", "/health") == (200, {"status": "ok"})
    st, props = req(server, "GET", "/props")
    assert st == 200 and props["total_slots"] == 4
    assert props["default_generation_settings"]["n_ctx"] == CTX
    assert "chat_template" in props and props["model_path"].endswith(".gguf")
    for path in ("/v1/models", "/models"):
        st, models = req(server, "GET", path)
        assert st == 200 and models["object"] == "list"
        ids = [m["id"] for m in models["data"]]
        assert ids[1:] == ["lora_attn", "lora_ffn", "lora_all_q8"]
    assert "GET /health 200" in " ".join(server.lines)


def test_health_503_while_loading(smollm_path):
    srv = ServerThread(None, ServerSettings(port=0)).start()
    try:
        st, body = req(srv, "GET", "/health")
        assert st == 503 and body["error"]["type"] == "unavailable_error"
        assert body["error"]["message"] == "Loading model"
        assert req(srv, "POST", "/completion", {"prompt": "x"})[0] == 503
        eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
        eng.load_model(smollm_path)
        srv.set_engine(eng)
        # loaded but its loop not running: no request would be served (issue #15)
        st, body = req(srv, "GET", "/health")
        assert st == 503 and "not running" in body["error"]["message"]
        eng.start()
        time.sleep(0.1)
        assert req(srv, "GET", "/health") == (200, {"status": "ok"})
        eng.stop()
    finally:
        srv.stop()


def test_unknown_endpoint_is_json_404(server):
    st, body = req(server, "GET", "/nope")
    assert st == 404 and body["error"]["type"] == "not_found_error"
    st, body = req(server, "GET", "/completion")
    assert st == 405 and "error" in body


def test_tokenize_detokenize_apply_template(server, reference):
    for case in reference["tokenize"]:
        st, out = req(
            server,
            "POST",
            "/tokenize",
            {"content": case["text"], "parse_special": case["parse_special"]},
        )
        assert st == 200 and out["tokens"] == case["tokens"], case["text"]
        st, back = req(server, "POST", "/detokenize", {"tokens": case["tokens"]})
        assert st == 200 and back["content"] == case["text"]
    st, out = req(server, "POST", "/tokenize", {"content": "Hello, world!", "with_pieces": True})
    assert out["tokens"][0] == {"id": 19556, "piece": "Hello"}
    st, out = req(server, "POST", "/tokenize", {"content": "<|im_start|>", "parse_special": False})
    assert len(out["tokens"]) > 1
    st, out = req(
        server, "POST", "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert st == 200 and out["prompt"].endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in out["prompt"]
    assert_400(*req(server, "POST", "/tokenize", {"content": 5}))
    assert_400(*req(server, "POST", "/detokenize", {"tokens": [10**9]}))
    assert_400(*req(server, "POST", "/apply-template", {"messages": "hi"}))


# ---- the global mix -----------------------------------------------------------------


def test_init_without_apply_reads_zero(server):
    st, ads = req(server, "GET", "/lora-adapters")
    assert st == 200 and [a["id"] for a in ads] == [0, 1, 2]
    for a in ads:
        assert {"id", "path", "scale", "task_name", "prompt_prefix"} <= set(a)
        assert a["scale"] == 0.0
    assert ads[0]["path"].endswith("lora_attn.gguf")


def test_post_lora_sets_mix_unlisted_zero(server):
    try:
        assert req(
            server, "POST", "/lora-adapters", [{"id": 0, "scale": 0.5}, {"id": 2, "scale": -1}]
        ) == (200, {"success": True})
        assert global_scales(server) == [0.5, 0.0, -1.0]
        assert req(server, "POST", "/lora-adapters", [{"id": 1, "scale": 2}])[0] == 200
        assert global_scales(server) == [0.0, 2.0, 0.0]
    finally:
        req(server, "POST", "/lora-adapters", [])
    assert global_scales(server) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "raw",
    [
        b'[{"id": 0, "scale": 1}',  # malformed JSON
        b'[{"id": 7, "scale": 1}]',  # unknown id
        b'[{"id": 0, "scale": "loud"}]',  # non-numeric scale
        b'[{"id": 0, "scale": null}]',
        b'[{"id": "0", "scale": 1}]',  # wrong type of id
        b'{"id": 0, "scale": 1}',  # object instead of list
        b"[0.5]",
        b'[{"id": 0, "scale": 1}, {"id": 99, "scale": 1}]',  # one bad entry spoils all
    ],
)
def test_invalid_post_lora_changes_nothing(server, raw):
    try:
        assert req(server, "POST", "/lora-adapters", [{"id": 1, "scale": 0.25}])[0] == 200
        st, body = req(server, "POST", "/lora-adapters", raw=raw)
        assert_400(st, body)
        assert global_scales(server) == [0.0, 0.25, 0.0]
        assert req(server, "GET", "/health")[0] == 200
    finally:
        req(server, "POST", "/lora-adapters", [])


# ---- completions and per-request mixes ----------------------------------------------


def test_completion_matches_reference_with_request_lora(server, greedy):
    case = greedy[7]  # lora_attn 2.0 + lora_all_q8 0.3
    st, out = req(
        server, "POST", "/completion", greedy_body(case, 16, lora=case["lora"], n_probs=10)
    )
    assert st == 200, out
    assert out["tokens"] == case["tokens"]
    assert out["stop"] is True and out["stop_type"] == "limit"
    assert out["tokens_predicted"] == 16 and out["tokens_evaluated"] == len(case["prompt_tokens"])
    for k in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "cache_n",
    ):
        assert k in out["timings"]
    assert isinstance(out["tokens_cached"], int)
    probs = out["completion_probabilities"]
    assert len(probs) == 16
    for step, ref_top in zip(probs, case["top_logprobs"]):
        assert set(step) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert len(step["top_logprobs"]) == 10
        assert set(step["top_logprobs"][0]) == {"id", "token", "logprob", "bytes"}
        assert step["top_logprobs"][0]["id"] == ref_top[0][0]
        assert abs(step["top_logprobs"][0]["logprob"] - ref_top[0][1]) < 0.05
    assert global_scales(server) == [0.0, 0.0, 0.0]  # the request changed nothing global


def test_no_lora_field_means_adapters_off_under_init_without_apply(server, greedy):
    base = greedy[0]  # all adapters at 0
    body = greedy_body(base, 4)
    st, out = req(server, "POST", "/completion", body)
    assert st == 200 and out["tokens"] == base["tokens"][:4]


def test_request_lora_overrides_global_for_that_request_only(server, greedy):
    base, attn, ffn = greedy[0], greedy[1], greedy[2]
    try:
        req(server, "POST", "/lora-adapters", [{"id": 0, "scale": 1}])
        # no lora field: the global mix (lora_attn at 1)
        assert (
            req(server, "POST", "/completion", greedy_body(attn, 4))[1]["tokens"]
            == attn["tokens"][:4]
        )
        # "lora": [] -> every adapter off
        assert (
            req(server, "POST", "/completion", greedy_body(base, 4, lora=[]))[1]["tokens"]
            == base["tokens"][:4]
        )
        # listing only lora_ffn: lora_attn (unlisted) is 0 for this request
        assert (
            req(server, "POST", "/completion", greedy_body(ffn, 4, lora=[{"id": 1, "scale": 1}]))[
                1
            ]["tokens"]
            == ffn["tokens"][:4]
        )
        assert global_scales(server) == [1.0, 0.0, 0.0]
    finally:
        req(server, "POST", "/lora-adapters", [])


@pytest.mark.parametrize(
    "lora",
    [[{"id": 9, "scale": 1}], [{"id": 0, "scale": "1"}], {"id": 0}, "all", [{"scale": 1}], None],
)
def test_invalid_request_lora_is_400(server, greedy, lora):
    body = greedy_body(greedy[0], 2)
    body["lora"] = lora
    assert_400(*req(server, "POST", "/completion", body))
    assert global_scales(server) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi"',
        b"[]",
        b"",
        b'{"prompt": 5}',
        b'{"prompt": "hi", "n_predict": "many"}',
        b'{"prompt": "hi", "temperature": [1]}',
        b'{"n_predict": 1}',
    ],
)
def test_invalid_completion_bodies_are_400(server, raw):
    assert_400(*req(server, "POST", "/completion", raw=raw))


def test_prompt_longer_than_context_is_400(server):
    st, body = req(server, "POST", "/completion", {"prompt": [198] * (CTX + 10), "n_predict": 1})
    assert st == 400 and body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["n_ctx"] == CTX
    st, body = req(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 1},
    )
    assert st == 400 and body["error"]["type"] == "exceed_context_size_error"


def test_streaming_completion(server, greedy):
    case = greedy[2]

    async def go():
        chunks = []
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server.url + "/completion",
                json=greedy_body(case, 6, stream=True, lora=case["lora"], n_probs=2),
            ) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    line = line.decode().strip()
                    if line:
                        assert line.startswith("data: ")
                        chunks.append(json.loads(line[6:]))
        return chunks

    chunks = run(go())
    toks = [t for c in chunks[:-1] for t in c["tokens"]]
    assert toks == case["tokens"][:6]
    assert all(c["stop"] is False for c in chunks[:-1])
    assert all(len(c["completion_probabilities"]) == len(c["tokens"]) for c in chunks[:-1])
    last = chunks[-1]
    assert last["stop"] is True and last["stop_type"] == "limit" and "timings" in last
    text = "".join(c["content"] for c in chunks)
    st, out = req(server, "POST", "/detokenize", {"tokens": case["tokens"][:6]})
    assert text == out["content"]


def test_concurrent_requests_with_different_mixes_are_batched_and_exact(server, greedy):
    cases = [greedy[1], greedy[10], greedy[20], greedy[29]]  # 4 prompts, 4 different mixes
    assert len({json.dumps(c["lora"]) for c in cases}) == 4
    eng = server.engine
    steps0 = eng.stats()["steps"]

    async def go():
        async with aiohttp.ClientSession() as s:

            async def one(case):
                async with s.post(
                    server.url + "/completion", json=greedy_body(case, 16, lora=case["lora"])
                ) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one(c) for c in cases))

    results = run(go())
    for case, (st, out) in zip(cases, results):
        assert st == 200 and out["tokens"] == case["tokens"], case["lora"]
    # Alone, these would take 4 x 17 forward steps; batched they share steps.
    assert eng.stats()["steps"] - steps0 < 40


def test_stream_disconnect_frees_the_slot(server, greedy):
    eng = server.engine

    async def go():
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                server.url + "/completion",
                json={
                    "prompt": "Tell me a long story.",
                    "n_predict": 200,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            assert r.status == 200
            await r.content.readline()  # the first token arrived
            assert eng.stats()["active"] == 1
            r.close()  # hang up mid-stream

    run(go())
    deadline = time.time() + 20
    while eng.stats()["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert not eng.stats()["active"]
    assert any("/completion 499" in line for line in server.lines)
    st, out = req(server, "POST", "/completion", greedy_body(greedy[0], 2))
    assert st == 200 and out["tokens"] == greedy[0]["tokens"][:2]


def test_non_streaming_disconnect_frees_the_slot(server):
    eng = server.engine

    async def go():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(
                    server.url + "/completion",
                    json={"prompt": "Once upon a time", "n_predict": 200, "ignore_eos": True},
                    timeout=aiohttp.ClientTimeout(total=1.5),
                )

    run(go())
    deadline = time.time() + 20
    while eng.stats()["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert not eng.stats()["active"]


# ---- OpenAI shapes ------------------------------------------------------------------


def test_v1_completions_openai_shape(server, greedy):
    case = greedy[0]
    body = {
        "prompt": case["prompt_tokens"],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    st, out = req(server, "POST", "/v1/completions", body)
    assert st == 200 and out["object"] == "text_completion"
    ch = out["choices"][0]
    assert ch["finish_reason"] == "length" and ch["index"] == 0
    assert len(ch["logprobs"]["tokens"]) == 3
    assert out["usage"]["completion_tokens"] == 3
    assert out["usage"]["prompt_tokens"] == len(case["prompt_tokens"])
    expected = req(server, "POST", "/detokenize", {"tokens": case["tokens"][:3]})[1]["content"]
    assert ch["text"] == expected

    async def stream():
        lines = []
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if line.strip():
                        lines.append(line.decode().strip())
        return lines

    lines = run(stream())
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" in chunks[-1]


def test_model_name_selects_adapter(server, greedy):
    attn = greedy[1]  # lora_attn alone at 1
    body = {
        "prompt": attn["prompt_tokens"],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "model": "lora_attn",
    }
    st, out = req(server, "POST", "/v1/completions", body)
    assert st == 200 and out["model"] == "lora_attn"
    assert out["lora"] == [
        {"id": 0, "scale": 1.0},
        {"id": 1, "scale": 0.0},
        {"id": 2, "scale": 0.0},
    ]
    expected = req(server, "POST", "/detokenize", {"tokens": attn["tokens"][:4]})[1]["content"]
    assert out["choices"][0]["text"] == expected
    assert global_scales(server) == [0.0, 0.0, 0.0]


def test_chat_with_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-none", max_retries=0)
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(
        model="anything",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        extra_body={"lora": [], "ignore_eos": True},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 4
    extra = r.model_extra
    assert "predicted_n" in extra["timings"] and extra["lora"][0] == {"id": 0, "scale": 0.0}

    stream = client.chat.completions.create(
        model="anything",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"lora": [], "ignore_eos": True},
    )
    pieces, finish = [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(pieces) == r.choices[0].message.content
    assert finish == "length"


def test_chat_raw_stream_ends_with_done_and_logprobs(server):
    async def go():
        lines = []
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server.url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2,
                    "stream": True,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "temperature": 0,
                },
            ) as r:
                async for line in r.content:
                    if line.strip():
                        lines.append(line.decode().strip())
        return lines

    lines = run(go())
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    lp = [c["choices"][0]["logprobs"]["content"][0] for c in chunks if c["choices"][0]["logprobs"]]
    assert lp and len(lp[0]["top_logprobs"]) == 2
    assert "usage" in chunks[-1] and "timings" in chunks[-1]


# ---- loading and unloading adapters -------------------------------------------------


def test_load_and_unload_adapter(server, ref_dir):
    st, entry = req(
        server,
        "POST",
        "/lora-adapters/load",
        {"path": str(ref_dir / "adapters" / "lora_ffn.gguf"), "scale": 0.0, "name": "ffn_copy"},
    )
    assert st == 200, entry
    assert {"id", "path", "scale", "task_name", "prompt_prefix"} <= set(entry)
    new_id = entry["id"]
    try:
        assert new_id in [a["id"] for a in req(server, "GET", "/lora-adapters")[1]]
        assert "ffn_copy" in [m["id"] for m in req(server, "GET", "/v1/models")[1]["data"]]
        # a duplicate name or a bad path changes nothing
        before = req(server, "GET", "/lora-adapters")[1]
        assert_400(
            *req(
                server,
                "POST",
                "/lora-adapters/load",
                {"path": str(ref_dir / "adapters" / "lora_ffn.gguf"), "name": "ffn_copy"},
            )
        )
        assert_400(
            *req(server, "POST", "/lora-adapters/load", {"path": str(ref_dir / "no-such.gguf")})
        )
        st, body = req(server, "POST", "/lora-adapters/load", {"path": "/no/such.gguf"})
        assert st == 403 and body["error"]["type"] == "permission_error"  # outside --lora-dir
        assert_400(
            *req(server, "POST", "/lora-adapters/load", {"path": str(ref_dir / "README.md")})
        )
        assert_400(*req(server, "POST", "/lora-adapters/load", {"scale": 1}))
        assert req(server, "GET", "/lora-adapters")[1] == before
    finally:
        assert req(server, "POST", "/lora-adapters/unload", {"id": new_id}) == (
            200,
            {"success": True},
        )
    assert [a["id"] for a in req(server, "GET", "/lora-adapters")[1]] == [0, 1, 2]
    assert_400(*req(server, "POST", "/lora-adapters/unload", {"id": new_id}))
    assert_400(*req(server, "POST", "/lora-adapters/unload", {"id": "x"}))


def test_vllm_load_select_unload(server, ref_dir, greedy):
    ffn = greedy[2]  # lora_ffn alone at 1
    st, text = req(
        server,
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "styleA", "lora_path": str(ref_dir / "adapters" / "lora_ffn.gguf")},
    )
    assert st == 200 and "styleA" in text
    try:
        models = [m["id"] for m in req(server, "GET", "/v1/models")[1]["data"]]
        assert "styleA" in models
        st, body = req(
            server,
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": "styleA", "lora_path": str(ref_dir / "adapters" / "lora_ffn.gguf")},
        )
        assert_400(st, body)
        # vLLM-loaded adapters start at 0: no effect unless selected
        assert global_scales(server)[-1] == 0.0
        st, out = req(
            server,
            "POST",
            "/v1/completions",
            {
                "prompt": ffn["prompt_tokens"],
                "max_tokens": 3,
                "temperature": 0,
                "ignore_eos": True,
                "model": "styleA",
            },
        )
        expected = req(server, "POST", "/detokenize", {"tokens": ffn["tokens"][:3]})[1]["content"]
        assert st == 200 and out["choices"][0]["text"] == expected
    finally:
        st, text = req(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "styleA"})
        assert st == 200
    st, body = req(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "styleA"})
    assert st == 404 and body["error"]["type"] == "not_found_error"
    assert "styleA" not in [m["id"] for m in req(server, "GET", "/v1/models")[1]["data"]]


def test_request_log_has_no_prompt_text(server):
    req(server, "POST", "/tokenize", {"content": "SECRET-TOKENIZE-TEXT"})
    req(server, "POST", "/completion", {"prompt": "SECRET-PROMPT-TEXT", "n_predict": 1})
    text = "\n".join(server.lines)
    assert "SECRET" not in text
    for line in server.lines:
        parts = line.split()
        assert parts[0] in ("GET", "POST", "OPTIONS") and parts[1].startswith("/")
        assert parts[-1] == "ms"


# --- chat prompt options, as llama-server reads them (#19) ---------------------------------


def test_apply_template_honours_add_generation_prompt_and_prefill(server):
    msgs = [{"role": "user", "content": "Hi"}]
    st, on = req(server, "POST", "/apply-template", {"messages": msgs})
    st2, off = req(
        server, "POST", "/apply-template", {"messages": msgs, "add_generation_prompt": False}
    )
    assert st == st2 == 200
    assert on["prompt"].endswith("<|im_start|>assistant\n")
    assert off["prompt"] == on["prompt"][: -len("<|im_start|>assistant\n")]
    prefill = msgs + [{"role": "assistant", "content": "Well,"}]
    st, cont = req(server, "POST", "/apply-template", {"messages": prefill})
    assert st == 200 and cont["prompt"] == on["prompt"] + "Well,"


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            "2 or more assistant",
        ),
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_chat_prompt_requests_llama_server_refuses_are_400(server, extra, match):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    for path in ("/apply-template", "/v1/chat/completions"):
        st, out = req(server, "POST", path, body)
        assert st == 400, (path, out)
        assert match in json.dumps(out)


# ---- merge methods (#21) --------------------------------------------------------------


def global_method(srv) -> dict:
    st, body = req(srv, "GET", "/mixdesk/mix")
    assert st == 200
    return body


def test_post_lora_object_form_sets_a_merge_method(server, greedy):
    # svd to rank 4: a real merge (the stacked ranks truncated) that builds in
    # milliseconds; ties & co. build the same way (tests/test_merge.py runs them)
    merge = {"method": "svd", "rank": 4}
    adapters = [{"id": 0, "scale": 0.9}, {"id": 2, "scale": 0.7}]
    try:
        assert req(server, "POST", "/lora-adapters", {"adapters": adapters, **merge}) == (
            200,
            {"success": True},
        )
        st, ads = req(server, "GET", "/lora-adapters")  # llama-server's listing, unchanged
        assert st == 200 and [a["scale"] for a in ads] == [0.9, 0.0, 0.7]
        assert all("method" not in a for a in ads)
        assert global_method(server) == {
            "adapters": [{"id": 0, "scale": 0.9}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.7}],
            **merge,
        }
        body = greedy_body(greedy[0], 8)
        st, under_global = req(server, "POST", "/completion", body)
        assert st == 200
        # the same merge as a request's own "lora" object: the same greedy tokens
        st, per_request = req(
            server, "POST", "/completion", {**body, "lora": {"adapters": adapters, **merge}}
        )
        assert st == 200 and per_request["tokens"] == under_global["tokens"]
        # llama-server's list form moves the faders and keeps the method
        assert req(server, "POST", "/lora-adapters", [{"id": 1, "scale": 0.5}])[0] == 200
        assert global_method(server)["method"] == "svd"
        assert global_scales(server) == [0.0, 0.5, 0.0]
    finally:
        req(server, "POST", "/lora-adapters", {"adapters": [], "method": "linear"})
    assert global_method(server) == {
        "adapters": [{"id": i, "scale": 0.0} for i in range(3)],
        "method": "linear",
    }


@pytest.mark.parametrize(
    "body",
    [
        {"adapters": [{"id": 0, "scale": 1}], "method": "slerp"},
        {"adapters": [{"id": 0, "scale": 1}], "method": "ties", "density": 0},
        {"adapters": [{"id": 0, "scale": 1}], "method": "ties", "density": 1.01},
        {"adapters": [{"id": 0, "scale": 1}], "method": "svd", "rank": -2},
        {"adapters": [{"id": 0, "scale": 1}], "method": "ties", "densty": 0.5},  # unknown field
        {"adapters": [{"id": 9, "scale": 1}], "method": "ties"},  # unknown adapter
        {"method": "ties", "density": 0.5},  # no adapters
        {"adapters": {"id": 0}, "method": "ties"},
    ],
)
def test_bad_merge_fields_are_400_and_change_nothing(server, greedy, body):
    dare = {"method": "dare_ties", "density": 0.5, "seed": 3, "majority_sign_method": "total"}
    try:
        assert req(
            server, "POST", "/lora-adapters", {"adapters": [{"id": 1, "scale": 0.25}], **dare}
        ) == (200, {"success": True})
        before = global_method(server)
        assert_400(*req(server, "POST", "/lora-adapters", body))
        assert global_method(server) == before
        # the same fields in a request's own "lora": a 400 too, and nothing runs
        assert_400(*req(server, "POST", "/completion", {**greedy_body(greedy[0], 2), "lora": body}))
        assert global_method(server) == before
    finally:
        req(server, "POST", "/lora-adapters", {"adapters": [], "method": "linear"})
