"""Browser-facing defences against a real server: API keys, Host (DNS rebinding),
Origin/CORS, body size. After every attack the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import aiohttp
import pytest

from tests.serving import running_engine, serving

KEY = "s3cret-key"
ALLOWED = "http://app.allowed.example"

ENDPOINTS = [
    ("GET", "/props"),
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/lora-adapters"),
    ("POST", "/lora-adapters"),
    ("POST", "/lora-adapters/load"),
    ("POST", "/lora-adapters/unload"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/completion"),
    ("POST", "/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/apply-template"),
]


@pytest.fixture(scope="module")
def engine(smollm_path, ref_dir):
    attn = ref_dir / "adapters" / "lora_attn.gguf"
    with running_engine(smollm_path, adapters=[attn], ctx_size=128, n_parallel=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def locked(engine):
    """API key and a CORS allow-list."""
    with serving(engine, api_keys=["other-key", KEY], cors_origins=[ALLOWED]) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_srv(engine):
    """Defaults: no key, no CORS."""
    with serving(engine) as srv:
        yield srv


def send(srv, method, path, body=None, raw=None, headers=None):
    async def go():
        async with aiohttp.ClientSession() as s:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            async with s.request(method, srv.url + path, data=data, headers=headers or {}) as r:
                text = await r.text()
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = text
                return r.status, payload, r.headers

    return asyncio.run(go())


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def still_serving(srv, headers=None):
    st, body, _ = send(
        srv, "POST", "/completion", {"prompt": "Hi", "n_predict": 1}, headers=headers
    )
    assert st == 200 and body["tokens_predicted"] == 1


# ---- API key ---------------------------------------------------------------------------


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_every_endpoint_but_health_needs_the_key(locked, method, path):
    st, body, _ = send(locked, method, path, {})
    assert st == 401 and body["error"]["type"] == "authentication_error"
    st, body, _ = send(locked, method, path, {}, headers=auth("wrong"))
    assert st == 401


def test_health_is_public_and_keys_work(locked):
    assert send(locked, "GET", "/health")[0] == 200
    assert send(locked, "GET", "/props", headers=auth())[0] == 200
    assert send(locked, "GET", "/props", headers=auth("other-key"))[0] == 200
    assert send(locked, "GET", "/props", headers={"x-api-key": KEY})[0] == 200
    assert send(locked, "GET", "/props", headers={"Authorization": KEY})[0] == 401
    assert send(locked, "GET", "/props", headers={"Authorization": "Bearer "})[0] == 401
    assert send(locked, "GET", "/props", headers=auth(KEY + "x"))[0] == 401
    still_serving(locked, auth())


def test_openai_client_with_key(locked):
    openai = pytest.importorskip("openai")
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].object == "model"


@pytest.fixture(scope="module")
def logged(engine):
    """An API key, a CORS allow-list, and the request log kept (srv.lines)."""
    lines: list[str] = []
    with serving(engine, api_keys=[KEY], cors_origins=[ALLOWED], on_log=lines.append) as srv:
        srv.lines = lines
        yield srv


def raw(srv, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte (headers aiohttp's client would refuse to
    send); (status, body) of the answer."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(head + b"\r\nHost: localhost\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


WRONG_KEY = json.dumps(
    {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
).encode()


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe",  # not UTF-8: once a 500 UnicodeEncodeError
        b"X-Api-Key: \xff",
        b"Authorization: Bearer s3cret\x00key",  # a NUL: once aiohttp's plain-text 400
        b"X-Api-Key: s3cret\x00key",
        b"Authorization: Bearer wrong-key",
    ],
)
def test_a_malformed_key_is_a_401_like_any_wrong_key(logged, header):
    assert raw(logged, b"GET /props HTTP/1.1\r\n" + header) == (401, WRONG_KEY)
    still_serving(logged, auth())


def test_the_key_is_never_logged_nor_echoed(logged, caplog):
    """A control character after the key makes aiohttp refuse the header line, and its
    own answer quoted that line, key and all, in the 400 body and an ERROR traceback."""
    n = len(logged.lines)
    answers = []
    with caplog.at_level(logging.DEBUG):
        for header in (
            f"Authorization: Bearer {KEY}\x01",
            f"X-Api-Key: {KEY}\x00",
            f"Authorization: Bearer {KEY}\x7f",
        ):
            answers.append(raw(logged, b"GET /props HTTP/1.1\r\n" + header.encode()))
        # a malformed header that is not a key's: a JSON 400 naming the fault, not the line
        answers.append(raw(logged, b"GET /props HTTP/1.1\r\nX-Note: " + KEY.encode() + b"\x01"))
        still_serving(logged, auth())
    assert answers[:3] == [(401, WRONG_KEY)] * 3
    st, body = answers[3]
    assert st == 400 and json.loads(body)["error"] == {
        "code": 400,
        "message": "malformed request: Invalid header value char",
        "type": "invalid_request_error",
    }
    logged_text = "\n".join(logged.lines[n:]) + caplog.text
    assert KEY not in logged_text and not any(KEY.encode() in b for _, b in answers)
    assert "Traceback" not in logged_text
    assert logged.lines[n:n + 4] == ["malformed request from 127.0.0.1: 401 (malformed API key header)"] * 3 + [
        "malformed request from 127.0.0.1: 400 (malformed request: Invalid header value char)"
    ]  # fmt: skip


def test_an_abrupt_disconnect_is_one_line_without_traceback(logged, caplog):
    """50 clients POST a whole /completion body and reset the connection at once: each
    is one INFO line of the request log (or nothing, if the server never read it),
    never aiohttp's 45-line ConnectionResetError traceback."""
    body = json.dumps({"prompt": "Hi", "n_predict": 4}).encode()
    head = (
        b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    n = len(logged.lines)
    with caplog.at_level(logging.DEBUG):
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", logged.port))
            s.sendall(head + body)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") * 2)
            s.close()  # linger 0: a reset, not a polite FIN
        still_serving(logged, auth())  # also gives the server time to see every reset
    disconnects = [ln for ln in logged.lines[n:] if "/completion 499" in ln]
    assert disconnects  # the reset did reach handlers that were reading the body
    assert all("(client disconnected)" in ln for ln in disconnects)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


# ---- Host header (DNS rebinding) -------------------------------------------------------


@pytest.mark.parametrize(
    "host,ok",
    [
        ("evil.example", False),
        ("evil.example:{port}", False),
        ("localhost.evil.example:{port}", False),
        ("10.1.2.3:{port}", False),
        ("localhost:{port}", True),
        ("127.0.0.1:{port}", True),
        ("[::1]:{port}", True),
    ],
)
def test_host_header_checked(open_srv, host, ok):
    st, body, _ = send(
        open_srv, "GET", "/health", headers={"Host": host.format(port=open_srv.port)}
    )
    if ok:
        assert st == 200
    else:
        assert st == 403 and body["error"]["type"] == "permission_error"
    st, _, _ = send(
        open_srv,
        "POST",
        "/lora-adapters",
        [{"id": 0, "scale": 1}],
        headers={"Host": host.format(port=open_srv.port)},
    )
    assert st == (200 if ok else 403)
    send(open_srv, "POST", "/lora-adapters", [])


def test_rebinding_cannot_change_mix(open_srv, engine):
    st, _, _ = send(
        open_srv,
        "POST",
        "/lora-adapters",
        [{"id": 0, "scale": 5}],
        headers={"Host": "attacker.example"},
    )
    assert st == 403 and engine.get_mix() == {0: 0.0}
    still_serving(open_srv)


# ---- Origin and CORS ------------------------------------------------------------------


def test_no_cors_headers_by_default(open_srv):
    for headers in ({}, {"Origin": f"http://127.0.0.1:{open_srv.port}"}):
        st, _, h = send(open_srv, "GET", "/health", headers=headers)
        assert st == 200 and not any(k.lower().startswith("access-control") for k in h)
    st, _, h = send(
        open_srv,
        "OPTIONS",
        "/completion",
        headers={"Origin": "http://any.example", "Access-Control-Request-Method": "POST"},
    )
    # llama-server's answer to a preflight it refuses: 200 without CORS headers, which
    # the browser reads as "no" (the request itself, if sent anyway, is a 403)
    assert st == 200 and not any(k.lower().startswith("access-control") for k in h)


def assert_simple_post_refused(srv, engine, origin):
    """A page on another site can send a 'simple' POST without preflight: it is a 403
    and the mix is untouched."""
    st, _, h = send(
        srv,
        "POST",
        "/lora-adapters",
        raw=b'[{"id": 0, "scale": 3}]',
        headers={"Origin": origin, "Content-Type": "text/plain"},
    )
    assert st == 403 and "Access-Control-Allow-Origin" not in h
    assert engine.get_mix() == {0: 0.0}


def test_cross_site_post_is_refused(open_srv, engine):
    for origin in ("http://evil.example", "null"):
        assert_simple_post_refused(open_srv, engine, origin)


def preflight(srv, path, origin, request_headers=None):
    """A browser's CORS preflight for a POST to ``path`` from ``origin``."""
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if request_headers:
        headers["Access-Control-Request-Headers"] = request_headers
    return send(srv, "OPTIONS", path, headers=headers)


def test_cors_allow_list(locked):
    st, _, h = preflight(locked, "/v1/chat/completions", ALLOWED, "authorization,content-type")
    assert st == 200 and h["Access-Control-Allow-Origin"] == ALLOWED
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert "authorization" in h["Access-Control-Allow-Headers"].lower()
    st, _, h = send(
        locked,
        "OPTIONS",
        "/v1/chat/completions",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert st == 200 and "Access-Control-Allow-Origin" not in h
    st, _, h = send(locked, "GET", "/props", headers={"Origin": ALLOWED, **auth()})
    assert st == 200 and h["Access-Control-Allow-Origin"] == ALLOWED
    st, _, h = send(locked, "GET", "/props", headers={"Origin": "http://evil.example", **auth()})
    assert st == 403 and "Access-Control-Allow-Origin" not in h
    st, _, h = send(locked, "GET", "/props", headers=auth())
    assert st == 200 and "Access-Control-Allow-Origin" not in h


@pytest.fixture(scope="module")
def loopback_cors(engine):
    """--cors-origins localhost: any loopback origin, on any port."""
    with serving(engine, cors_origins=["localhost"]) as srv:
        yield srv


LOOPBACK_ORIGINS = [
    "http://localhost",
    "http://localhost:8080",
    "https://localhost:5173",
    "http://127.0.0.1",
    "http://127.0.0.1:3000",
    "http://127.5.6.7:9",
    "http://[::1]",
    "http://[::1]:3000",
]
NOT_LOOPBACK = [
    "http://web.mydomain.fr",
    "http://evil.com",
    "http://notlocalhost",
    "http://localhost.evil.com",
    "http://127.0.0.1.evil.com",
    "http://[::2]:3000",
    "file://localhost",
    "null",
    "http://localhost:notaport",
]


@pytest.mark.parametrize("origin", LOOPBACK_ORIGINS)
def test_cors_localhost_means_any_loopback_origin(loopback_cors, origin):
    st, _, h = preflight(loopback_cors, "/completions", origin, "Authorization")
    assert st == 200 and h["Access-Control-Allow-Origin"] == origin
    st, body, h = send(
        loopback_cors, "POST", "/completion", {"prompt": "Hi", "n_predict": 1},
        headers={"Origin": origin},
    )  # fmt: skip
    assert st == 200 and h["Access-Control-Allow-Origin"] == origin and "content" in body


@pytest.mark.parametrize("origin", NOT_LOOPBACK)
def test_cors_localhost_refuses_every_other_origin(loopback_cors, engine, origin):
    st, _, h = preflight(loopback_cors, "/completions", origin)
    assert st == 200 and not any(k.lower().startswith("access-control") for k in h)
    assert_simple_post_refused(loopback_cors, engine, origin)


def test_a_refused_preflight_is_200_as_llama_server_and_the_log_says_why(logged):
    """llama-server answers every preflight 200 and its own tests assert it (test_security's
    test_cors_origins_localhost_rejects): no Access-Control-Allow-Origin is the refusal.
    The request log names the origin and the flag, as llama-server's warning does."""
    n = len(logged.lines)
    st, _, h = preflight(logged, "/completion", "http://evil.example", "authorization")
    assert st == 200 and not any(k.lower().startswith("access-control") for k in h)
    assert logged.lines[n].startswith("OPTIONS /completion 200 ")
    assert logged.lines[n].endswith(
        "(CORS: origin http://evil.example refused, see --cors-origins)"
    )
    st, _, h = preflight(logged, "/completion", ALLOWED, "authorization")
    assert st == 200 and h["Access-Control-Allow-Origin"] == ALLOWED
    assert "CORS" not in logged.lines[n + 1]


def test_cors_header_on_streams(locked):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(
                locked.url + "/completion",
                json={"prompt": "Hi", "n_predict": 1, "stream": True},
                headers={"Origin": ALLOWED, **auth()},
            ) as r:
                await r.read()
                return r.status, r.headers

    st, h = asyncio.run(go())
    assert st == 200 and h["Access-Control-Allow-Origin"] == ALLOWED


# ---- body size -------------------------------------------------------------------------


def test_body_over_8_mib_is_413(open_srv):
    big = b'{"content": "' + b"a" * (8 << 20) + b'"}'
    st, body, _ = send(open_srv, "POST", "/tokenize", raw=big)
    assert st == 413 and body["error"]["code"] == 413

    async def chunked():  # no Content-Length: the read limit applies
        async def gen():
            for _ in range(9):
                yield b"a" * (1 << 20)

        async with aiohttp.ClientSession() as s:
            async with s.post(open_srv.url + "/completion", data=gen()) as r:
                return r.status

    assert asyncio.run(chunked()) == 413
    still_serving(open_srv)


def test_body_just_under_the_limit_is_read(open_srv):
    body = b'{"tokens": [' + b" " * ((8 << 20) - 100) + b"1]}"
    st, out, _ = send(open_srv, "POST", "/detokenize", raw=body)
    assert st == 200 and "content" in out


def test_survives_garbage(open_srv):
    for raw in (b"\x00\xff" * 100, b"{" * 10000, b"[" * 200000, b'{"prompt": "' + b"\xc3" + b'"}'):
        st, body, _ = send(open_srv, "POST", "/completion", raw=raw)
        assert st == 400 and body["error"]["type"] == "invalid_request_error"
    still_serving(open_srv)


@pytest.mark.parametrize(
    "path, body",
    [("/lora-adapters/unload", {"id": 0}), ("/v1/unload_lora_adapter", {"lora_name": "lora_attn"})],
)
def test_unloading_over_http_needs_the_runtime_flag_too(open_srv, engine, path, body):
    """Unloading changes the server's adapter set as loading does: without
    --allow-runtime-lora it is a 403 and the adapter stays (the docs always said so,
    and /control-vectors/unload already refused)."""
    before = send(open_srv, "GET", "/lora-adapters")[1]
    status, payload, _ = send(open_srv, "POST", path, body)
    assert status == 403, payload
    assert "--allow-runtime-lora" in json.dumps(payload)
    assert send(open_srv, "GET", "/lora-adapters")[1] == before
    assert engine.adapters
