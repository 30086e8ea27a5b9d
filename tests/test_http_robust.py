"""The HTTP server against hostile or broken clients (issue #15): runtime adapter
loading off by default and confined to the adapter folders, bad token ids, lone
surrogates, racing loads, chat templates that never end, bounded blocking pools,
forged log lines, stalled connections, API keys from a file or the environment.

Real SmolLM2, real servers on 127.0.0.1, a real aiohttp client (and raw sockets for
the slow clients). Every hostile file is written here into tmp_path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import threading
import time

import aiohttp
import pytest

from core.chat_template import ChatTemplate, RenderLimits
from core.errors import HttpError
from core.http import ServerSettings, ServerThread
from core.http.plumbing import BlockingPool
from core.serve.events import AdaptersChanged
from tests.serving import running_engine, serving

KEY = "k3y-that-must-never-be-logged"
SECRET = b"TOPSECRET-FILE-CONTENT\n"
N_VOCAB = 49152


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir):
    attn = ref_dir / "adapters" / "lora_attn.gguf"
    with running_engine(smollm_path, adapters=[attn], ctx_size=128, n_parallel=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def folders(tmp_path_factory, ref_dir):
    """An adapter folder (one real adapter, one file that is not an adapter, a
    symlink out of the folder) and, outside it, a secret file."""
    root = tmp_path_factory.mktemp("robust")
    lora_dir = root / "adapters"
    lora_dir.mkdir()
    shutil.copy(ref_dir / "adapters" / "lora_ffn.gguf", lora_dir / "ffn.gguf")
    (lora_dir / "not_an_adapter.gguf").write_bytes(SECRET)
    secret = root / "secret.txt"
    secret.write_bytes(SECRET)
    (lora_dir / "escape.gguf").symlink_to(secret)
    return lora_dir, secret


@pytest.fixture(scope="module")
def default_srv(engine):
    """Defaults: runtime adapter loading off."""
    lines: list[str] = []
    with serving(engine, on_log=lines.append) as srv:
        srv.lines = lines
        yield srv


@pytest.fixture(scope="module")
def lora_srv(engine, folders):
    """--allow-runtime-lora --lora-dir <folder>, short timeouts for the slow-client tests."""
    lines: list[str] = []
    with serving(
        engine,
        on_log=lines.append,
        allow_runtime_lora=True,
        lora_dirs=[folders[0]],
        idle_timeout=1.0,
        body_timeout=1.0,
    ) as srv:
        srv.lines = lines
        yield srv


async def call(srv, method, path, body=None, raw: bytes | None = None, headers=None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        async with s.request(method, srv.url + path, data=data, headers=headers or {}) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def req(srv, method, path, body=None, **kw):
    return asyncio.run(call(srv, method, path, body, **kw))


def assert_error(status, body, code, type_="invalid_request_error"):
    assert status == code, body
    assert body["error"]["code"] == code and body["error"]["type"] == type_, body
    return body["error"]["message"]


def adapter_ids(srv):
    return [a["id"] for a in req(srv, "GET", "/lora-adapters")[1]]


# ---- item 10: runtime adapter loading ----------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/lora-adapters/load", {"path": "/etc/passwd"}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/passwd"}),
    ],
)
def test_runtime_lora_is_off_by_default(default_srv, path, body):
    before = adapter_ids(default_srv)
    msg = assert_error(*req(default_srv, "POST", path, body), 403, "permission_error")
    assert "--allow-runtime-lora" in msg and "root:" not in msg
    assert adapter_ids(default_srv) == before


def test_no_file_probe_when_off(default_srv, folders):
    """Existing and missing files answer the same: nothing is opened."""
    _, secret = folders
    a = req(default_srv, "POST", "/lora-adapters/load", {"path": str(secret)})
    b = req(default_srv, "POST", "/lora-adapters/load", {"path": str(secret) + ".missing"})
    assert a == b and a[0] == 403


def test_loads_only_inside_the_adapter_folders(lora_srv, folders):
    lora_dir, secret = folders
    before = adapter_ids(lora_srv)
    for path in [
        str(secret),  # outside
        str(lora_dir / ".." / secret.name),  # .. out of the folder
        str(lora_dir / "escape.gguf"),  # a symlink pointing out
        "../" + secret.name,  # relative, climbing out
        "/etc/passwd",
    ]:
        st, body = req(lora_srv, "POST", "/lora-adapters/load", {"path": path})
        msg = assert_error(st, body, 403, "permission_error")
        assert "TOPSECRET" not in msg and "root:" not in msg
    assert adapter_ids(lora_srv) == before


def test_error_never_quotes_file_content(lora_srv, folders):
    lora_dir, _ = folders
    path = str(lora_dir / "not_an_adapter.gguf")
    for route, body in [
        ("/lora-adapters/load", {"path": path}),
        ("/v1/load_lora_adapter", {"lora_name": "n", "lora_path": path}),
    ]:
        msg = assert_error(*req(lora_srv, "POST", route, body), 400)
        assert "not_an_adapter.gguf" in msg
        assert "TOPSECRET" not in msg and "TOPS" not in msg and "b'" not in msg


def test_relative_name_loads_from_the_folder(lora_srv):
    st, entry = req(lora_srv, "POST", "/lora-adapters/load", {"path": "ffn.gguf", "scale": 0})
    assert st == 200, entry
    try:
        assert entry["path"].endswith("ffn.gguf")
    finally:
        assert req(lora_srv, "POST", "/lora-adapters/unload", {"id": entry["id"]})[0] == 200


def test_overlong_and_nul_paths_are_400(lora_srv, default_srv):
    long = "/tmp/" + "a" * 5000
    msg = assert_error(*req(lora_srv, "POST", "/lora-adapters/load", {"path": long}), 400)
    assert "too long" in msg and len(msg) < 400
    assert_error(*req(lora_srv, "POST", "/lora-adapters/load", {"path": "a\u0000b"}), 400)
    assert req(default_srv, "POST", "/lora-adapters/load", {"path": long})[0] == 403


def test_unload_racing_a_load_is_a_clear_answer(lora_srv, engine):
    """An unload of the id a load is about to return (here: done by an engine listener
    the moment the adapter appears) used to end the handler with 'coroutine raised
    StopIteration', a 500."""
    removed: list[int] = []

    def unload_new(ev):
        if isinstance(ev, AdaptersChanged) and not removed:
            newest = max(a["id"] for a in ev.adapters)
            if newest > 0:
                removed.append(newest)
                engine.remove_adapter(newest)

    unsubscribe = engine.subscribe(unload_new)
    try:
        st, body = req(lora_srv, "POST", "/lora-adapters/load", {"path": "ffn.gguf"})
    finally:
        unsubscribe()
    assert removed, "the racing unload did not happen"
    msg = assert_error(st, body, 409)
    assert "unloaded" in msg
    assert removed[0] not in adapter_ids(lora_srv)


# ---- item 8: token ids and invalid text --------------------------------------------------


@pytest.mark.parametrize("bad", [N_VOCAB, 2**63, -(2**63), -1, 10**30])
@pytest.mark.parametrize("route", ["/completion", "/v1/completions"])
def test_out_of_range_prompt_token_is_400_naming_it(default_srv, route, bad):
    st, body = req(default_srv, "POST", route, {"prompt": [1, bad], "n_predict": 1})
    msg = assert_error(st, body, 400)
    assert str(bad) in msg


@pytest.mark.parametrize("bad", [N_VOCAB, 2**63, -(2**63)])
def test_out_of_range_detokenize_is_400(default_srv, bad):
    msg = assert_error(*req(default_srv, "POST", "/detokenize", {"tokens": [bad]}), 400)
    assert str(bad) in msg


@pytest.mark.parametrize(
    "route, extra",
    [
        ("/completion", {"prompt": "hi", "stop": "\ud800"}),
        ("/completion", {"prompt": "hi", "stop": ["ok", "\udfff"]}),
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "model": "\ud800"},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\udc00"}]}),
    ],
)
def test_lone_surrogate_is_400_before_any_stream(default_srv, route, extra):
    raw = json.dumps({**extra, "stream": True, "n_predict": 2, "max_tokens": 2}).encode()
    assert b"\\ud" in raw
    msg = assert_error(*req(default_srv, "POST", route, raw=raw), 400)
    assert "surrogate" in msg


def test_valid_surrogate_pair_is_fine(default_srv):
    raw = json.dumps({"content": "smile \U0001f600"}).encode()  # ensure_ascii: \ud83d\ude00
    assert b"\\ud83d" in raw
    st, body = req(default_srv, "POST", "/tokenize", raw=raw)
    assert st == 200 and body["tokens"]


# ---- item 7: chat templates off the event loop, with limits --------------------------------

ENDLESS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"


@pytest.fixture()
def hostile_template(engine):
    saved = engine.chat_template
    engine.chat_template = ChatTemplate(ENDLESS, limits=RenderLimits(seconds=2.0))
    yield
    engine.chat_template = saved


def test_endless_template_is_400_and_the_server_keeps_answering(default_srv, hostile_template):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def go():
        pending = asyncio.ensure_future(call(default_srv, "POST", "/v1/chat/completions", chat))
        await asyncio.sleep(0.3)
        health = await call(default_srv, "GET", "/health")
        tokenized = await call(default_srv, "POST", "/tokenize", {"content": "still here"})
        still_rendering = not pending.done()
        return health, tokenized, still_rendering, await pending

    health, tokenized, still_rendering, chat_answer = asyncio.run(go())
    assert health == (200, {"status": "ok"}) and tokenized[0] == 200
    assert still_rendering  # /health was answered while the template was running
    msg = assert_error(*chat_answer, 400)
    assert "longer than 2 s" in msg
    msg = assert_error(*req(default_srv, "POST", "/apply-template", chat), 400)
    assert "chat template" in msg


def test_the_render_limit_is_the_requests_not_each_renders(default_srv, monkeypatch):
    """A prompt may render the template up to three times (the system-role probe, and
    twice for a continued message); each render once had the whole limit of its own,
    so a slow template answered after 2x or 3x the limit. Every render of one prompt
    now runs against one deadline, read here from the renders themselves (not from the
    wall clock, so a busy machine changes nothing)."""
    from core import chat_template

    deadlines: list[float] = []
    real_init = chat_template._Budget.__init__

    def recording_init(self, *args, **kw):
        real_init(self, *args, **kw)
        deadlines.append(self.deadline)

    monkeypatch.setattr(chat_template._Budget, "__init__", recording_init)
    # a trailing assistant message is continued: two renders of the template at least
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    status, body = req(default_srv, "POST", "/apply-template", {"messages": messages})
    assert status == 200, body
    assert len(deadlines) >= 2, f"expected the continued message's two renders: {deadlines}"
    assert len(set(deadlines)) == 1, f"the renders had {len(set(deadlines))} deadlines"


def test_huge_template_output_is_400(default_srv, engine):
    saved = engine.chat_template
    engine.chat_template = ChatTemplate("{{ 'x' * 10**9 }}")
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        msg = assert_error(*req(default_srv, "POST", "/v1/chat/completions", chat), 400)
        assert "over the limit" in msg
    finally:
        engine.chat_template = saved


# ---- item 4: bounded pools for blocking work ---------------------------------------------


def test_blocking_pool_refuses_beyond_its_queue_and_times_out():
    gate = threading.Event()

    async def go():
        pool = BlockingPool("test", workers=1, queue=1, timeout=30.0)
        first = asyncio.ensure_future(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(pool.run(lambda: "second"))
        await asyncio.sleep(0.05)
        with pytest.raises(HttpError) as busy:
            await pool.run(lambda: "third")
        gate.set()
        results = [await first, await second]
        after = await pool.run(lambda: "after")  # the places are free again
        slow = BlockingPool("slow", workers=1, queue=0, timeout=0.2)
        hang = threading.Event()
        with pytest.raises(HttpError) as timed_out:
            await slow.run(hang.wait)
        with pytest.raises(HttpError) as still_busy:  # the hung call keeps its place
            await slow.run(lambda: None)
        hang.set()
        await asyncio.sleep(0.1)
        return (
            busy.value,
            results,
            after,
            timed_out.value,
            still_busy.value,
            await slow.run(lambda: "freed"),
        )

    busy, results, after, timed_out, still_busy, freed = asyncio.run(go())
    assert busy.code == 503 and "busy" in busy.message
    assert results == [True, "second"] and after == "after"
    assert timed_out.code == 503 and "longer than 0.2 s" in timed_out.message
    assert still_busy.code == 503 and freed == "freed"


def test_errors_from_the_pool_thread_reach_the_handler():
    async def go():
        pool = BlockingPool("test", workers=1, queue=1, timeout=5.0)
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
        return await pool.run(lambda: "ok")

    assert asyncio.run(go()) == "ok"


@pytest.mark.parametrize("leaves_by", ["cancel", "timeout"])
def test_a_call_that_fails_after_its_handler_left_logs_no_unretrieved_error(caplog, leaves_by):
    """A handler that stops waiting (its client hung up, or the pool's timeout) leaves
    the call running; when that call then fails, nobody is there to hear it. Its error
    must not be left on a future nobody reads: asyncio logs such a future as "exception
    was never retrieved" when it is collected, at a random later moment, from whatever
    the process is doing then (in 3.11 that log formats a traceback with ``ast``, which
    broke an unrelated ``ast.parse`` it interrupted)."""
    import gc

    started, failed = threading.Event(), threading.Event()

    def fail_when(gate):
        started.set()
        assert gate.wait(60)
        failed.set()
        raise RuntimeError("failed after the handler left")

    async def go():
        gate = threading.Event()
        pool = BlockingPool(
            "test", workers=1, queue=1, timeout=0.2 if leaves_by == "timeout" else 30.0
        )
        call = asyncio.ensure_future(pool.run(fail_when, gate))
        assert await asyncio.to_thread(started.wait, 60)  # the call runs on its thread
        if leaves_by == "cancel":
            call.cancel()
        with pytest.raises(asyncio.CancelledError if leaves_by == "cancel" else HttpError):
            await call
        gate.set()
        # waits for the place, which is free once the failure has settled on this loop
        assert await pool.run(lambda: "after") == "after"

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(go())
        gc.collect()
    assert failed.is_set()  # the call did fail, after its handler had gone
    assert "never retrieved" not in caplog.text


# ---- item 11: logs, keys, slow clients -----------------------------------------------------


def test_control_characters_in_paths_cannot_forge_log_lines(default_srv):
    n = len(default_srv.lines)
    st, body = req(default_srv, "GET", "/x%0aGET%20/health%20200%201.0%20ms%0d")
    assert st == 404 and "\n" not in body["error"]["message"]
    new = default_srv.lines[n:]
    assert len(new) == 1 and "\n" not in new[0] and "\r" not in new[0]
    assert "\\n" in new[0] and new[0].endswith("ms")


def test_api_key_is_never_logged(engine, caplog):
    lines: list[str] = []
    settings = ServerSettings(port=0, api_keys=[KEY], verbose=True, on_log=lines.append)
    srv = ServerThread(engine, settings).start()
    try:
        with caplog.at_level(logging.DEBUG):
            good = {"Authorization": f"Bearer {KEY}"}
            bad = {"Authorization": f"Bearer {KEY}x", "X-Api-Key": KEY + "y"}
            assert req(srv, "POST", "/tokenize", {"content": "a"}, headers=good)[0] == 200
            assert req(srv, "POST", "/tokenize", {"content": "a"}, headers=bad)[0] == 401
            assert req(srv, "GET", "/nope", headers=good)[0] == 404
            req(srv, "POST", "/completion", {"prompt": "a", "n_predict": 1}, headers=good)
    finally:
        srv.stop()
    logged = "\n".join(lines) + caplog.text
    assert lines and KEY not in logged


def _slow_client(port: int, payload: bytes, pause: float, budget: float) -> tuple[bytes, float]:
    """Send ``payload`` one byte every ``pause`` s; return what came back and when."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=budget) as s:
        try:
            for b in payload:
                s.sendall(bytes([b]))
                time.sleep(pause)
        except OSError:  # the server closed the connection under us
            pass
        s.settimeout(budget)
        try:
            return s.recv(65536), time.monotonic() - t0
        except OSError:
            return b"", time.monotonic() - t0


def test_slowloris_headers_are_dropped(lora_srv):
    headers = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200
    got, _ = _slow_client(lora_srv.port, headers, pause=0.05, budget=30)
    assert got == b""  # closed without an answer, long before the headers were done
    assert req(lora_srv, "GET", "/health")[0] == 200


def test_trickled_body_times_out_with_json(lora_srv):
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", lora_srv.port), timeout=30) as s:
        s.sendall(head + b'{"content": ')
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert b" 408 " in status_line, data
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 408 and "did not arrive" in body["error"]["message"]
    assert req(lora_srv, "GET", "/health")[0] == 200


# ---- command line: keys from a file or the environment, adapter folders -------------------


def test_api_key_file_and_environment(tmp_path, monkeypatch):
    from core.cli import parse_args

    keys = tmp_path / "keys.txt"
    keys.write_text("first-key\n\n  second-key  \n", encoding="utf-8")
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    assert parse_args(["--api-key-file", str(keys)]).api_key == ["first-key", "second-key"]
    assert parse_args(["--api-key", "a", "--api-key-file", str(keys)]).api_key == [
        "a",
        "first-key",
        "second-key",
    ]
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    assert parse_args([]).api_key == ["from-env"]
    assert parse_args(["--api-key", "flag"]).api_key == ["flag"]  # the flag wins
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    for bad in [empty, tmp_path / "missing.txt", tmp_path]:
        with pytest.raises(SystemExit):
            parse_args(["--api-key-file", str(bad)])


def test_lora_dir_flags(tmp_path, monkeypatch):
    from core.cli import parse_args
    from core.paths import data_dir

    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    off = ServerSettings.from_args(parse_args([]))
    assert off.allow_runtime_lora is False
    on = ServerSettings.from_args(
        parse_args(["--allow-runtime-lora", "--lora-dir", str(tmp_path), "--lora-dir", "."])
    )
    assert on.allow_runtime_lora and [str(p) for p in on.lora_dirs] == [str(tmp_path), "."]
    given = tmp_path / "sub" / "a.gguf"
    default = ServerSettings.from_args(parse_args(["--allow-runtime-lora", "--lora", str(given)]))
    assert default.lora_dirs == [given.parent, data_dir() / "adapters"]
    with pytest.raises(SystemExit):
        parse_args(["--lora-dir", str(tmp_path)])  # without --allow-runtime-lora
    with pytest.raises(SystemExit):
        parse_args(["--allow-runtime-lora", "--lora-dir", str(tmp_path / "nope")])
    assert os.environ.get("LLAMA_API_KEY") is None


def test_runtime_lora_on_a_network_address_is_warned_about(tmp_path):
    from core.http import exposure_warnings

    assert exposure_warnings(ServerSettings(allow_runtime_lora=True, lora_dirs=[tmp_path])) == []
    warned = exposure_warnings(
        ServerSettings(
            host="0.0.0.0", api_keys=["k"], allow_runtime_lora=True, lora_dirs=[tmp_path]
        )
    )
    assert len(warned) == 2 and str(tmp_path) in warned[1]
