"""Fields and formats a llama-server script relies on (issue #20), against a real server
on 127.0.0.1 with the real SmolLM2: build_info / system_fingerprint, the full
generation_settings, post_sampling_probs, response_fields, verbose, the timings'
generation rate, the streamed chat's first and last chunks, and 501 for what is off.
"""

from __future__ import annotations

import json
import math
import re

import aiohttp
import pytest
from test_http_api import req, run

from core.http.build_info import build_info
from tests.serving import running_engine, serving

BUILD = re.compile(r"^b\d+-[0-9a-f]{7,}$|^b0-unknown$")


@pytest.fixture(scope="module")
def server(smollm_path):
    with running_engine(smollm_path, ctx_size=256, n_parallel=2) as eng, serving(eng) as srv:
        yield srv


async def sse(srv, path, body) -> list:
    out = []
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.url + path, json=body) as r:
            assert r.status == 200
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def test_build_info_is_llama_servers_form(server):
    assert BUILD.match(build_info())
    st, props = req(server, "GET", "/props")
    assert st == 200 and props["build_info"] == build_info()
    st, out = req(server, "POST", "/v1/chat/completions", CHAT)
    assert st == 200 and out["system_fingerprint"] == build_info()


def test_generation_settings_carry_llama_servers_fields(server):
    st, out = req(server, "POST", "/completion", {"prompt": "Hello", "n_predict": 1})
    gs = out["generation_settings"]
    for key in (
        "adaptive_target",
        "adaptive_decay",
        "logit_bias",
        "dry_multiplier",
        "mirostat",
        "typical_p",
        "xtc_probability",
        "n_keep",
        "grammar",
        "post_sampling_probs",
        "timings_per_token",
        "samplers",
        "lora",
    ):
        assert key in gs, key
    assert out["prompt"].endswith("Hello")


def test_post_sampling_probs_gives_probabilities(server):
    body = {"prompt": "The capital of France is", "n_predict": 3, "n_probs": 5}
    st, out = req(server, "POST", "/completion", {**body, "post_sampling_probs": True})
    assert st == 200 and out["generation_settings"]["post_sampling_probs"] is True
    probs = out["completion_probabilities"]
    assert len(probs) == 3
    for tok in probs:
        assert 0.0 < tok["prob"] <= 1.0 and "logprob" not in tok
        assert tok["top_probs"] and all(0.0 < p["prob"] <= 1.0 for p in tok["top_probs"])
        assert "top_logprobs" not in tok
    # the same request without it keeps llama-server's log form, same numbers
    st, plain = req(server, "POST", "/completion", {**body, "temperature": 0})
    st, post = req(
        server, "POST", "/completion", {**body, "temperature": 0, "post_sampling_probs": True}
    )
    a, b = plain["completion_probabilities"][0], post["completion_probabilities"][0]
    assert a["id"] == b["id"] and math.isclose(math.exp(a["logprob"]), b["prob"])


def test_response_fields_filter_the_body(server):
    fields = ["content", "generation_settings/n_predict", "prompt", "no_such/field", "nope"]
    st, out = req(
        server,
        "POST",
        "/completion",
        {"prompt": "Hello", "n_predict": 2, "response_fields": fields},
    )
    assert st == 200
    assert set(out) == {"content", "generation_settings/n_predict", "prompt"}
    assert out["generation_settings/n_predict"] == 2
    st, out = req(server, "POST", "/completion", {"prompt": "x", "response_fields": "content"})
    assert st == 400 and "response_fields" in out["error"]["message"]


def test_verbose_adds_the_full_body(server):
    st, out = req(
        server,
        "POST",
        "/completion",
        {"prompt": "Hello", "n_predict": 1, "verbose": True, "response_fields": ["content"]},
    )
    assert st == 200 and set(out) == {"content", "__verbose"}
    assert out["__verbose"]["tokens_predicted"] == 1
    st, out = req(server, "POST", "/completion", {"prompt": "Hello", "n_predict": 1})
    assert "__verbose" not in out


def test_generation_rate_counts_n_minus_one_steps(server):
    st, one = req(server, "POST", "/completion", {"prompt": "Hi", "n_predict": 1})
    t = one["timings"]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0.0
    assert t["predicted_per_token_ms"] == 0.0
    body = {"prompt": "Hi", "n_predict": 6, "ignore_eos": True}
    st, six = req(server, "POST", "/completion", body)
    t = six["timings"]
    assert t["predicted_n"] == 6
    assert math.isclose(t["predicted_per_second"], 1e3 / t["predicted_ms"] * 5)


def test_streamed_chat_first_chunk_and_usage_chunk(server):
    chunks = run(sse(server, "/v1/chat/completions", {**CHAT, "stream": True}))
    first = chunks[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": None}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert all(c["system_fingerprint"] == build_info() for c in chunks)
    # include_usage: the finish chunk, then usage + timings with empty choices
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks = run(sse(server, "/v1/chat/completions", body))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-2]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert "timings" in last and last["id"] == chunks[0]["id"]


def test_stream_options_must_be_an_object(server):
    st, out = req(server, "POST", "/v1/chat/completions", {**CHAT, "stream_options": 3})
    assert st == 400 and "stream_options" in out["error"]["message"]


@pytest.mark.parametrize(
    "method, path, flag",
    [
        ("GET", "/metrics", "--metrics"),
        ("POST", "/slots/0?action=save", "--slot-save-path"),
        ("POST", "/embedding", "--embeddings"),
        ("POST", "/v1/embeddings", "--embeddings"),
        ("POST", "/rerank", "--reranking"),
    ],
)
def test_a_feature_that_is_off_answers_501(server, method, path, flag):
    st, out = req(server, method, path, {"content": "x"})
    assert st == 501
    assert out["error"]["type"] == "not_supported_error" and flag in out["error"]["message"]


def test_truncated_when_the_context_fills(server):
    # a long prompt leaves ~20 positions to generate: filling 256 positions one decode
    # step at a time took longer than aiohttp's 5-minute client timeout on a loaded VM
    prompt = "Hi how are you? " * 46
    body = {"prompt": prompt, "n_predict": -1, "ignore_eos": True, "temperature": 0}
    st, out = req(server, "POST", "/completion", body)
    assert st == 200 and out["truncated"] is True and out["stop_type"] == "limit"
    assert 200 < out["tokens_evaluated"] < 250
    assert out["tokens_evaluated"] + out["tokens_predicted"] == 256
    st, out = req(server, "POST", "/completion", {**body, "n_predict": 4})
    assert out["truncated"] is False and out["stop_type"] == "limit"


def test_chat_input_tokens_and_verbose(server):
    msgs = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}]}
    st, out = req(server, "POST", "/chat/completions/input_tokens", msgs)
    assert st == 200
    st, chat = req(server, "POST", "/v1/chat/completions", {**msgs, "max_tokens": 1})
    assert out == {"input_tokens": chat["usage"]["prompt_tokens"]}
    st, out = req(server, "POST", "/chat/completions/input_tokens", {"messages": []})
    assert st == 400
    st, chat = req(
        server, "POST", "/v1/chat/completions", {**msgs, "max_tokens": 1, "verbose": True}
    )
    assert "Book" in chat["__verbose"]["prompt"] and chat["__verbose"]["tokens_predicted"] == 1
    st, cmpl = req(
        server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "verbose": True}
    )
    assert cmpl["__verbose"]["prompt"].endswith("Hi")
    st, chat = req(server, "POST", "/v1/chat/completions", {**msgs, "max_tokens": 1})
    assert "__verbose" not in chat


def test_verbose_without_response_fields_is_not_circular(server):
    # the whole body and its __verbose copy were one dict: JSON refused it, a 500
    st, out = req(server, "POST", "/completion", {"prompt": "Hi", "n_predict": 1, "verbose": True})
    assert st == 200 and out["__verbose"]["content"] == out["content"]
