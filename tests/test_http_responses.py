"""Pure parts of the HTTP API: body parsing, response shapes, host and exposure rules.
No server, no model."""

from __future__ import annotations

import json

import pytest

from core.errors import HttpError
from core.http import parsing as P
from core.http import responses as R
from core.http.app import ServerSettings
from core.http.security import host_allowed, is_loopback, same_origin, split_host
from core.http.server import exposure_warnings
from core.serve.scheduler import DoneEvent, Timings
from core.tokenizer import utf8_complete_len


class FakeTok:
    """Characters as tokens (ord), BOS 1 when add_special."""

    def encode(self, text, add_special=False, parse_special=False):
        return ([1] if add_special else []) + [ord(c) for c in text]

    def token_bytes(self, tid):
        return {7: b"\xe2\x82"}.get(tid, chr(tid).encode("utf-8"))

    def token_str(self, tid):
        return self.token_bytes(tid).decode("utf-8", errors="replace")

    def probs_piece(self, tid):  # the real Tokenizer's rule: drop an incomplete tail
        b = self.token_bytes(tid)
        return b[: utf8_complete_len(b)].decode("utf-8", errors="replace"), b


@pytest.mark.parametrize(
    "raw", [b"", b"  ", b"{bad", b"\xff\xfe", b"[1, 2]", b'"x"', b"null", b"[" * 100000]
)
def test_json_body_rejects_non_objects(raw):
    with pytest.raises(HttpError) as e:
        P.parse_json_body(raw)
    assert e.value.code == 400 and e.value.type == "invalid_request_error"
    assert set(R.error_body(e.value.message, e.value.code, e.value.type)["error"]) == {
        "code",
        "message",
        "type",
    }


def test_prompt_forms():
    tok = FakeTok()
    assert P.parse_prompt("ab", tok) == [1, 97, 98]
    assert P.parse_prompt([5, 6], tok) == [5, 6]  # tokens: no BOS
    assert P.parse_prompt(["ab"], tok) == [1, 97, 98]
    assert P.parse_prompt(["a", 5, "b"], tok) == [1, 97, 5, 98]  # BOS only for leading text
    assert P.parse_prompt([5, "a"], tok) == [5, 97]
    assert P.parse_prompt({"prompt_string": "a"}, tok) == [1, 97]
    for bad in (None, 3, [], [True], [1.5], ["a", "b"], {"x": 1}):
        with pytest.raises(HttpError):
            P.parse_prompt(bad, tok)


def test_sampling_fields_are_type_checked():
    p = P.parse_sampling({"n_predict": 5, "temperature": 0, "top_k": 3, "stop": "x", "seed": -1})
    assert (p.n_predict, p.temperature, p.top_k, p.stop, p.seed) == (5, 0.0, 3, ["x"], None)
    assert P.parse_sampling({}, n_predict_default=7).n_predict == 7
    assert P.parse_sampling({"max_tokens": 3}, oai=True).n_predict == 3
    assert P.parse_sampling({"max_completion_tokens": 2, "max_tokens": 3}, oai=True).n_predict == 2
    for body in (
        {"temperature": "hot"},
        {"n_predict": 1.5},
        {"top_k": True},
        {"stop": [1]},
        {"top_p": 2},
        {"n_probs": 1000},
        {"ignore_eos": "yes"},
        {"seed": "1"},
        {"temperature": float("nan")},
    ):
        with pytest.raises(HttpError):
            P.parse_sampling(body)
    with pytest.raises(HttpError):
        P.parse_generation({"n": 100})  # more completions than one request may ask
    with pytest.raises(HttpError):
        P.parse_generation({"lora": None})


def test_messages_and_tokens_validation():
    assert P.parse_messages({"messages": [{"role": "user", "content": "hi"}]})
    for body in (
        {},
        {"messages": []},
        {"messages": ["hi"]},
        {"messages": [{"content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ):
        with pytest.raises(HttpError):
            P.parse_messages(body)
    assert P.parse_token_list([1, 2], 10) == [1, 2]
    for bad in ("x", [1, "2"], [10], [-1], [True]):
        with pytest.raises(HttpError):
            P.parse_token_list(bad, 10)


def test_probability_shapes():
    tok = FakeTok()
    e = R.completion_probability(tok, 65, -0.5, [(65, -0.5), (7, -1.0)])
    assert e == {
        "id": 65,
        "token": "A",
        "logprob": -0.5,
        "bytes": [65],
        "top_logprobs": [
            {"id": 65, "token": "A", "logprob": -0.5, "bytes": [65]},
            # an incomplete character: no text, all its bytes (llama-server's rule)
            {"id": 7, "token": "", "logprob": -1.0, "bytes": [0xE2, 0x82]},
        ],
    }
    assert R.token_piece(tok, 65) == "A" and R.token_piece(tok, 7) == [0xE2, 0x82]
    c = R.oai_chat_logprob(tok, 65, -0.5, [(65, -0.5), (66, -2.0)], 1)
    assert c["token"] == "A" and len(c["top_logprobs"]) == 1


def _done(stop="limit"):
    return DoneEvent(
        stop,
        "hi",
        [5, 6],
        Timings(prompt_n=3, prompt_ms=1.0, predicted_n=2, predicted_ms=2.0, cache_n=1),
        ((1, 0.5),),
    )


def test_completion_and_openai_shapes():
    d = _done()
    out = R.completion_final(
        d, prompt_n=4, model="m", all_ids=[0, 1], return_tokens=True, probs=[], settings={}
    )
    for k in (
        "content",
        "tokens",
        "stop",
        "stop_type",
        "tokens_cached",
        "timings",
        "completion_probabilities",
    ):
        assert k in out
    assert out["tokens"] == [5, 6] and out["stop_type"] == "limit" and out["tokens_cached"] == 1
    assert out["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
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
    assert (
        R.completion_final(
            d, prompt_n=4, model="m", all_ids=[], return_tokens=False, probs=None, settings={}
        )["tokens"]
        == []
    )
    chat = R.oai_chat(
        _done("eos"), cid="c", created=1, model="m", prompt_n=4, all_ids=[1], logprobs=None
    )
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"] == {
        "completion_tokens": 2,
        "prompt_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    cmpl = R.oai_completion(d, cid="c", created=1, model="m", prompt_n=4, all_ids=[], logprobs=None)
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["finish_reason"] == "length"
    assert R.sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    json.dumps([chat, cmpl, out])


def test_models_list_includes_adapters():
    m = R.models_list(
        "base", {"n_vocab": 3}, [{"id": 0, "name": "pirate", "path": "/p", "scale": 0.0}]
    )
    assert [d["id"] for d in m["data"]] == ["base", "pirate"]
    assert m["data"][1]["parent"] == "base" and m["object"] == "list"


@pytest.mark.parametrize(
    "header,bind,ok",
    [
        ("localhost:8080", "127.0.0.1", True),
        ("LOCALHOST", "127.0.0.1", True),
        ("localhost.:8080", "127.0.0.1", True),
        ("127.0.0.1:8080", "127.0.0.1", True),
        ("127.1.2.3", "127.0.0.1", True),
        ("[::1]:8080", "127.0.0.1", True),
        ("evil.example:8080", "127.0.0.1", False),
        ("localhost.evil.example", "127.0.0.1", False),
        ("192.168.1.5:8080", "127.0.0.1", False),
        ("192.168.1.5:8080", "192.168.1.5", True),
        ("mybox.lan:8080", "mybox.lan", True),
        ("192.168.1.5:8080", "0.0.0.0", True),
        ("evil.example", "0.0.0.0", False),
        ("", "127.0.0.1", False),
        (None, "127.0.0.1", False),
    ],
)
def test_host_allowed(header, bind, ok):
    assert host_allowed(header, bind) is ok


def test_host_helpers():
    assert split_host("[::1]:80") == "::1" and split_host("a:1") == "a"
    assert is_loopback("::1") and not is_loopback("10.0.0.1")
    assert same_origin("http://127.0.0.1:8080", "127.0.0.1:8080")
    assert not same_origin("http://evil.example", "127.0.0.1:8080")


def test_exposure_warnings():
    assert ServerSettings().host == "127.0.0.1"
    assert exposure_warnings(ServerSettings(host="127.0.0.1")) == []
    assert exposure_warnings(ServerSettings(host="localhost")) == []
    assert len(exposure_warnings(ServerSettings(host="0.0.0.0"))) == 2
    assert len(exposure_warnings(ServerSettings(host="0.0.0.0", api_keys=["k"]))) == 1
    assert len(exposure_warnings(ServerSettings(host="192.168.1.5"))) == 2
