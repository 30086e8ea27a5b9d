"""A bounded, seeded fuzz of the HTTP API against a real server (SmolLM2, -np 2).

Random bodies for the real routes (wrong types, huge/negative/NaN numbers, unicode,
lone surrogates, deep nesting, garbage bytes), a few at a time. Every answer must be
a 2xx or a JSON 4xx (never a 500, never a dropped connection, never an error
inside a 200 stream), the server must answer a control request between batches,
and the control request's greedy output must be the same after the fuzz as before.
The context is small (64) so that any generation a fuzzed body asks for stays short.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from urllib.parse import quote

import aiohttp
import pytest

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

# MIXDESK_FUZZ_SEED / MIXDESK_FUZZ_CASES explore beyond the suite's fixed run
SEED = int(os.environ.get("MIXDESK_FUZZ_SEED", "1515"))
CASES = int(os.environ.get("MIXDESK_FUZZ_CASES", "240"))
BATCH = 4  # requests in flight at once (two engine slots)
CONTROL_EVERY = 10  # batches between control requests
N_VOCAB = 49152
GENERATION = ("/completion", "/v1/completions", "/v1/chat/completions")

# resumable streams: the conversation ids requests name (X-Conversation-Id) and the
# /v1/stream routes, drawn from their own generator so the cases above stay the same
CONV_IDS = ["fuzz", "fuzz::org/model:Q8_0", "x" * 600, "a b", "%00", "fuzz"]
OFFSETS = ["0", "1", "-1", "x", "99999999999999999999", "", "5e3"]
STREAM_CASES = 40

ROUTES = [
    ("GET", "/health"),
    ("GET", "/props"),
    ("GET", "/v1/models"),
    ("GET", "/lora-adapters"),
    ("POST", "/lora-adapters"),
    ("POST", "/lora-adapters/load"),
    ("POST", "/lora-adapters/unload"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/completion"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/apply-template"),
    ("POST", "/no/such/route"),
    ("DELETE", "/completion"),
]

FIELDS = {
    "/completion": ["prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "seed"],
    "/v1/completions": ["prompt", "max_tokens", "temperature", "logprobs", "model", "seed"],
    "/v1/chat/completions": ["messages", "max_tokens", "model", "logprobs", "top_logprobs"],
    "/tokenize": ["content", "add_special", "parse_special", "with_pieces"],
    "/detokenize": ["tokens"],
    "/apply-template": ["messages"],
    "/lora-adapters/load": ["path", "scale", "name"],
    "/lora-adapters/unload": ["id"],
    "/v1/load_lora_adapter": ["lora_name", "lora_path"],
    "/v1/unload_lora_adapter": ["lora_name", "lora_int_id"],
}
SHARED = [
    "stream",
    "stop",
    "lora",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "n_probs",
    "ignore_eos",
    "cache_prompt",
    "return_tokens",
    "n",
]

NUMBERS = [
    0,
    1,
    -1,
    2,
    3,
    40,
    0.5,
    -0.5,
    1.5,
    N_VOCAB,
    N_VOCAB - 1,
    2**31,
    2**63,
    -(2**63),
    2**64 + 1,
    10**30,
    1e300,
    -1e300,
    1e-300,
    float("nan"),
    float("inf"),
    float("-inf"),
]
STRINGS = [
    "",
    "hello",
    "The capital of France is",
    "<|im_start|>user\nhi<|im_end|>",
    "\ud800",
    "x\udfffy",
    "smile \U0001f600",
    "\u0000\u0001\n\r\t",
    "ünïcödé ℵ 中文 العربية",
    "%0a%00",
    "../../../../etc/passwd",
    "/etc/shadow",
    "lora_attn.gguf",
    "a" * 3000,
    "{{ 'x' * 10**9 }}",
]


def fuzz_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.35:
        return rng.choice(NUMBERS)
    if r < 0.65:
        return rng.choice(STRINGS)
    if r < 0.72:
        return rng.choice([True, False, None])
    if r < 0.86 and depth < 3:
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3:
        return {
            rng.choice(["id", "scale", "role", "content", "type", "text", "x"]): fuzz_value(
                rng, depth + 1
            )
            for _ in range(rng.randint(0, 3))
        }
    return rng.choice(NUMBERS + STRINGS)


def plausible(rng: random.Random, field: str):
    """A value of the right kind (often wrong only in range), so that bodies get past
    the first type check and reach deeper code."""
    if field == "prompt":
        return rng.choice(
            [
                rng.choice(STRINGS[1:4]),
                [rng.randint(0, N_VOCAB - 1) for _ in range(rng.randint(1, 6))],
                [1, rng.choice(NUMBERS)],
                ["text", rng.choice(NUMBERS)],
            ]
        )
    if field == "messages":
        return [
            {
                "role": rng.choice(["user", "system", "assistant", "tool", ""]),
                "content": rng.choice(
                    [rng.choice(STRINGS), [{"type": "text", "text": rng.choice(STRINGS)}]]
                ),
            }
            for _ in range(rng.randint(1, 3))
        ]
    if field in ("n_predict", "max_tokens"):
        return rng.choice([1, 2, 4, 0, -1, rng.choice(NUMBERS)])
    if field == "lora":
        return [{"id": rng.choice([0, 1, 5, -1]), "scale": rng.choice(NUMBERS)}]
    if field in ("path", "lora_path"):
        return rng.choice(["lora_attn.gguf", "README.md", "/etc/passwd", "../x", "a" * 5000])
    if field == "tokens":
        return [rng.choice(NUMBERS) if rng.random() < 0.3 else rng.randint(0, 1000)]
    return fuzz_value(rng)


SANE = {  # valid values: a body made of these reaches the engine
    "prompt": lambda rng: rng.choice(
        [rng.choice(STRINGS[1:4] + STRINGS[6:9]), [rng.randint(0, N_VOCAB - 1) for _ in range(3)]]
    ),
    "messages": lambda rng: [{"role": "user", "content": rng.choice(STRINGS[1:4] + STRINGS[6:9])}],
    "n_predict": lambda rng: rng.choice([1, 2, 3]),
    "max_tokens": lambda rng: rng.choice([1, 2, 3]),
    "temperature": lambda rng: rng.choice([0, 0.7, 1.5, 100.0]),
    "top_k": lambda rng: rng.choice([0, 1, 40, N_VOCAB * 2]),
    "top_p": lambda rng: rng.choice([0.0, 0.5, 1.0]),
    "min_p": lambda rng: rng.choice([0.0, 0.1, 1.0]),
    "seed": lambda rng: rng.choice([0, 42, -1, 2**32 + 5]),
    "stream": lambda rng: rng.choice([True, False]),
    "stop": lambda rng: rng.choice(["\n", ["the", "ü"], [], "😀"]),
    "lora": lambda rng: [{"id": 0, "scale": rng.choice([0.0, 0.5, -2.0])}],
    "repeat_penalty": lambda rng: rng.choice([1.0, 1.3, 0.5]),
    "repeat_last_n": lambda rng: rng.choice([-1, 0, 64]),
    "presence_penalty": lambda rng: rng.choice([0.0, 1.5, -2.0]),
    "frequency_penalty": lambda rng: rng.choice([0.0, 1.5]),
    "n_probs": lambda rng: rng.choice([0, 3]),
    "logprobs": lambda rng: rng.choice([False, True, 2]),
    "ignore_eos": lambda rng: rng.choice([True, False]),
    "cache_prompt": lambda rng: rng.choice([True, False]),
    "return_tokens": lambda rng: rng.choice([True, False]),
    "model": lambda rng: rng.choice(["x", "lora_attn", ""]),
}


def sane_generation(rng: random.Random, path: str) -> dict:
    body = {"prompt" if path != "/v1/chat/completions" else "messages": None}
    for f in [*FIELDS[path], *rng.sample(SHARED, 4)]:
        if f in SANE and (f in body or rng.random() < 0.5):
            body[f] = SANE[f](rng)
    body.pop("n", None)
    if path == "/v1/completions" and body.get("logprobs") is True:
        body["logprobs"] = 1
    if path == "/v1/chat/completions" and not isinstance(body.get("logprobs"), bool):
        body.pop("logprobs", None)
    body.setdefault("n_predict", 2)
    body.setdefault("max_tokens", 2)
    return body


def stream_case(rng: random.Random) -> tuple[str, str, bytes | None]:
    conv = quote(rng.choice(CONV_IDS), safe="")
    kind = rng.random()
    if kind < 0.4:
        return "GET", f"/v1/stream?conv_id={conv}&from={rng.choice(OFFSETS)}", None
    if kind < 0.6:
        return "DELETE", f"/v1/stream?conv_id={conv}" if rng.random() < 0.8 else "/v1/stream", None
    ids = rng.choice([[rng.choice(CONV_IDS)], CONV_IDS, fuzz_value(rng), None])
    return "POST", "/v1/streams/lookup", json.dumps({"conversation_ids": ids}).encode()


def make_case(rng: random.Random) -> tuple[str, str, bytes | None]:
    method, path = rng.choice(ROUTES)
    if method == "GET":
        return method, path, None
    r = rng.random()
    if r < 0.06:
        return (
            method,
            path,
            rng.choice(
                [b"", b"{", b"[]", b"null", b"\xff\xfe", b"[" * 5000, b'{"a":' * 3000, b"NaN"]
            ),
        )
    if path in GENERATION and r < 0.45:
        return method, path, json.dumps(sane_generation(rng, path)).encode()
    if path == "/lora-adapters":
        body = [{"id": rng.choice([0, 1, 9]), "scale": rng.choice(NUMBERS)}]
        return method, path, json.dumps(body).encode()
    fields = FIELDS.get(path, []) + rng.sample(SHARED, 3)
    body = {}
    for f in fields:
        if rng.random() < 0.6:
            body[f] = plausible(rng, f) if rng.random() < 0.7 else fuzz_value(rng)
    if "n_predict" not in body and "max_tokens" not in body:
        body["n_predict"] = body["max_tokens"] = rng.choice([1, 3])
    if rng.random() < 0.1:
        body[rng.choice(["zz", "", "\u00e9"])] = fuzz_value(rng)
    return method, path, json.dumps(body).encode()  # NaN/Infinity: Python's JSON accepts them


@pytest.fixture(scope="module")
def server(smollm_path, ref_dir):
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=2))
    eng.load_model(smollm_path)
    eng.add_adapter(ref_dir / "adapters" / "lora_attn.gguf", scale=0.0)
    eng.start()
    settings = ServerSettings(
        port=0, n_predict_default=4, allow_runtime_lora=True, lora_dirs=[ref_dir / "adapters"]
    )
    srv = ServerThread(eng, settings).start()
    yield srv
    srv.stop()
    eng.stop()


CONTROL = {
    "prompt": "The capital of France is",
    "n_predict": 6,
    "temperature": 0,
    "ignore_eos": True,
    "return_tokens": True,
    "lora": [],  # all adapters off, whatever the fuzz did to the global mix
}


async def control(session, url) -> list[int]:
    async with session.post(url + "/completion", json=CONTROL) as r:
        body = await r.json()
        assert r.status == 200, body
        return body["tokens"]


async def send(session, url, method, path, raw, conv=None) -> tuple[int, str | None]:
    """(status, None) if the answer is acceptable, else (status, what was wrong)."""
    headers = {"Content-Type": "application/json"}
    if conv is not None:
        headers["X-Conversation-Id"] = conv
    try:
        async with session.request(method, url + path, data=raw, headers=headers) as r:
            text = await r.text(errors="replace")
            status, ctype = r.status, r.headers.get("Content-Type", "")
    except (aiohttp.ClientError, TimeoutError) as e:
        return 0, f"connection failed: {type(e).__name__}: {e}"
    if status >= 500:
        return status, f"{status}: {text[:300]}"
    if 400 <= status < 500:
        try:
            err = json.loads(text)["error"]
            assert err["code"] == status and err["message"] and err["type"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return status, f"{status} without a JSON error body: {text[:300]}"
        return status, None
    if "text/event-stream" in ctype:
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events:
            return status, "empty stream"
        for ev in events:
            if ev != "[DONE]" and '"error"' in ev and json.loads(ev).get("error"):
                return status, f"error inside a 200 stream: {ev[:300]}"
    return status, None


def test_fuzz_the_api(server):
    rng = random.Random(SEED)
    cases = [make_case(rng) for _ in range(CASES)]
    srng = random.Random(SEED + 1)
    convs = [srng.choice(CONV_IDS) if srng.random() < 0.3 else None for _ in cases]
    cases += [stream_case(srng) for _ in range(STREAM_CASES)]
    convs += [None] * STREAM_CASES

    async def go():
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            before = await control(session, server.url)
            failures: list[str] = []
            generated = 0  # generation requests that got a 200: the fuzz reached the engine
            for n, i in enumerate(range(0, len(cases), BATCH)):
                batch = cases[i : i + BATCH]
                results = await asyncio.gather(
                    *(
                        send(session, server.url, m, p, raw, conv)
                        for (m, p, raw), conv in zip(batch, convs[i : i + BATCH], strict=True)
                    )
                )
                for (m, p, raw), (status, bad) in zip(batch, results, strict=True):
                    generated += status == 200 and p in GENERATION
                    if bad is not None:
                        failures.append(f"{m} {p} {(raw or b'')[:200]!r} -> {bad}")
                if n % CONTROL_EVERY == CONTROL_EVERY - 1:
                    assert await control(session, server.url) == before, "control output changed"
            after = await control(session, server.url)
            async with session.get(server.url + "/health") as r:
                health = r.status
            return before, after, failures, health, generated

    before, after, failures, health, generated = asyncio.run(go())
    assert not failures, "\n".join(failures[:20])
    print(f"fuzz: {generated} generation requests answered 200")
    assert generated >= 10, f"only {generated} fuzzed generation requests got a 200"
    assert after == before and len(before) == 6
    assert health == 200
