"""logit_bias (both llama-server forms, both route families), n > 1 choices and several
prompts in one request, against a real server on 127.0.0.1 with the real SmolLM2.
Bad inputs are 400s and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from core.serve.sampling import SamplingError, SamplingParams, make_sampler, parse_logit_bias
from tests.serving import running_engine, serving

CTX = 512
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(smollm_path):
    with running_engine(smollm_path, ctx_size=CTX, n_parallel=4) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as srv:
        yield srv


async def call(srv, path, body=None, raw: bytes | None = None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body)
        async with s.post(srv.url + path, data=data) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def post(srv, path, body=None, raw: bytes | None = None):
    return asyncio.run(call(srv, path, body, raw))


def sse_events(srv, path, body) -> list[dict]:
    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.url + path, json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        out.append(json.loads(line[6:]))
        return out

    return asyncio.run(go())


def greedy(srv, **extra):
    st, body = post(
        srv,
        "/completion",
        {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "return_tokens": True, **extra},
    )
    assert st == 200, body
    return body


# ---- logit_bias ------------------------------------------------------------------------


def test_logit_bias_bans_in_both_forms_on_both_routes(server):
    first = greedy(server)["tokens"][0]
    # llama-server's list form, false = never
    banned = greedy(server, logit_bias=[[first, False]])
    assert banned["tokens"][0] != first
    assert banned["generation_settings"]["logit_bias"] == [{"bias": None, "token": first}]
    # the OpenAI map on /v1/completions, a large negative bias
    st, body = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "logit_bias": {str(first): -100},
            "logprobs": 1,
        },
    )
    assert st == 200, body
    got = body["choices"][0]["logprobs"]["tokens"][0]
    assert got != server_piece(server, first)


def server_piece(server, tid):
    st, body = post(server, "/detokenize", {"tokens": [tid]})
    return body["content"]


def test_logit_bias_forces_a_token_at_any_temperature(server, engine):
    forced = engine.tokenizer.encode(" banana")[0]
    out = greedy(server, logit_bias=[[forced, 100]])
    assert out["tokens"] == [forced] * 4
    st, body = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 3,
            "temperature": 1.5,
            "seed": 3,
            "logit_bias": {str(forced): 100},
        },
    )
    assert st == 200, body
    assert body["choices"][0]["message"]["content"] == " banana" * 3


def test_logit_bias_token_given_as_text_is_tokenized(server, engine):
    first = greedy(server)["tokens"][0]
    piece = engine.tokenizer.token_str(first)
    out = greedy(server, logit_bias=[[piece, False]])
    assert out["tokens"][0] != first
    # the map form with a non-numeric key is text too (llama-server's rule)
    out = greedy(server, logit_bias={piece: False})
    assert out["tokens"][0] != first


@pytest.mark.parametrize(
    "bias, words",
    [
        ([[49152, 1.0]], ["49152", "out of range"]),
        ({"-1": 1.0}, ["out of range"]),
        ([[5, True]], ["finite number or false"]),
        ([[5, "x"]], ["finite number or false"]),
        ([5, 1.0], ["pair"]),
        ("5", ["logit_bias"]),
        ([[None, 1.0]], ["token id or a string"]),
    ],
)
def test_bad_logit_bias_is_400(server, bias, words):
    for path, body in (
        ("/completion", {"prompt": "hi", "n_predict": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        st, out = post(server, path, {**body, "max_tokens": 1, "logit_bias": bias})
        assert st == 400, out
        for w in words:
            assert w in out["error"]["message"], out
    assert greedy(server)["tokens_predicted"] == 4


@pytest.mark.parametrize("raw_bias", [b"NaN", b"Infinity", b"1e999"])
def test_non_finite_bias_is_400_and_the_server_keeps_serving(server, raw_bias):
    raw = b'{"prompt": "hi", "n_predict": 1, "logit_bias": [[5, ' + raw_bias + b"]]}"
    st, out = post(server, "/completion", raw=raw)
    assert st == 400, out
    assert greedy(server)["tokens_predicted"] == 4


def test_minus_infinity_in_the_map_bans(server):
    first = greedy(server)["tokens"][0]
    raw = json.dumps({"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True})
    raw = raw[:-1] + f', "logit_bias": {{"{first}": -Infinity}}}}'
    st, out = post(server, "/completion", raw=raw.encode())
    assert st == 200, out
    assert out["tokens"][0] != first


def test_sampler_applies_the_bias_before_everything(engine):
    tok = engine.tokenizer
    bias = parse_logit_bias([[7, False], [" the", 2.5]], tok, tok.vocab_size)
    the = tok.encode(" the")
    assert bias == {7: float("-inf"), **{t: 2.5 for t in the}}
    logits = np.zeros(100, dtype=np.float32)
    logits[7] = 50.0
    assert (
        make_sampler(SamplingParams(temperature=0, logit_bias={7: float("-inf")}))(logits, []) != 7
    )
    # a finite bias beyond float32 forces, it does not overflow into an error
    s = make_sampler(SamplingParams(temperature=0.8, seed=1, logit_bias={3: 1e300}))
    assert s(logits, []) == 3
    with pytest.raises(SamplingError, match="out of range"):
        parse_logit_bias({"100": 1}, tok, 100)


# ---- n > 1 and several prompts ---------------------------------------------------------


def test_n_choices_are_batched_seeded_and_distinct(server, engine):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 42, "n": 3}
    body["ignore_eos"] = True  # every choice runs its 8 tokens
    steps = engine.scheduler.steps
    st, a = post(server, "/v1/completions", body)
    ran = engine.scheduler.steps - steps
    assert st == 200, a
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    # batched: 3 x 8 tokens took about the steps of one sequence, not three
    assert ran <= 8 + 2, ran
    assert a["usage"]["completion_tokens"] == 3 * 8  # usage adds up every choice
    texts = [c["text"] for c in a["choices"]]
    assert len(set(texts)) > 1, texts  # seed + j: the choices differ
    st, b = post(server, "/v1/completions", body)
    assert [c["text"] for c in b["choices"]] == texts  # and the seed reproduces them


def test_n_on_chat_and_n_cmpl_on_completion(server):
    st, body = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 6,
            "temperature": 0.9,
            "seed": 1,
            "n": 2,
            "logprobs": True,
        },
    )
    assert st == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"]["content"] for c in body["choices"])  # each its own logprobs
    assert all(c["message"]["role"] == "assistant" for c in body["choices"])
    assert body["usage"]["completion_tokens"] <= 12
    st, out = post(
        server, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "n_cmpl": 2}
    )
    assert st == 200, out
    assert isinstance(out, list) and [r["index"] for r in out] == [0, 1]
    assert out[0]["content"] == out[1]["content"]  # greedy: the same text twice


def test_several_prompts_on_completion_and_v1(server):
    prompts = [PROMPT, "One, two, three,", [1, 504, 3458]]
    singles = [
        post(server, "/completion", {"prompt": p, "n_predict": 4, "temperature": 0})[1]["content"]
        for p in prompts
    ]
    st, out = post(server, "/completion", {"prompt": prompts, "n_predict": 4, "temperature": 0})
    assert st == 200, out
    assert [r["index"] for r in out] == [0, 1, 2]
    assert [r["content"] for r in out] == singles  # batched, yet exactly what each gives alone
    st, body = post(
        server, "/v1/completions", {"prompt": prompts[:2], "max_tokens": 4, "temperature": 0}
    )
    assert st == 200, body
    assert [c["text"] for c in body["choices"]] == singles[:2]
    assert [c["index"] for c in body["choices"]] == [0, 1]


def test_streaming_n_choices_carry_their_index(server):
    events = sse_events(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 5,
            "temperature": 0,
            "n": 2,
            "stream": True,
        },
    )
    text = {0: "", 1: ""}
    finished = set()
    for e in events:
        for c in e["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == {0, 1}
    assert text[0] == text[1] and text[0]  # greedy: both choices the same
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    chunks = sse_events(
        server,
        "/completion",
        {"prompt": [PROMPT, "Hello"], "n_predict": 3, "temperature": 0, "stream": True},
    )
    finals = [c for c in chunks if c["stop"]]
    assert sorted(c["index"] for c in finals) == [0, 1]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "hi", "n": 10_000}, ["too many", "16"]),
        ({"prompt": "hi", "n": 0}, ["at least 1"]),
        ({"prompt": "hi", "n": "3"}, ["n must be an integer"]),
        ({"prompt": ["a", "b", "c", "d", "e"], "n": 4}, ["20 completions"]),
    ],
)
def test_bad_n_is_400_and_the_server_keeps_serving(server, body, words):
    st, out = post(server, "/v1/completions", {**body, "max_tokens": 1})
    assert st == 400, out
    for w in words:
        assert w in out["error"]["message"], out
    assert greedy(server)["tokens_predicted"] == 4
