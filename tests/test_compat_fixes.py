"""Fields llama.cpp's own server tests read (issue #20, make compat), each checked on a
real server over real SmolLM2."""

from __future__ import annotations

import pytest
from test_http_api import req
from test_logit_bias_and_n import sse_events

from core.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    build_prompt,
    resolve_template_arg,
)
from core.cli import parse_args
from tests.serving import running_engine, serving


@pytest.fixture(scope="module")
def eng(smollm_path):
    with running_engine(smollm_path, ctx_size=256, n_parallel=1) as e:
        yield e


@pytest.fixture(scope="module")
def server(eng):
    with serving(eng) as srv:
        yield srv


def complete(server, **body):
    st, out = req(server, "POST", "/completion", {"prompt": "Once upon a time", **body})
    assert st == 200, out
    return out


def test_ignore_eos_echoes_the_end_of_generation_ban_in_logit_bias(server, eng):
    out = complete(server, n_predict=2, ignore_eos=True, temperature=0)
    bias = out["generation_settings"]["logit_bias"]
    # every end-of-generation token, banned (null = -inf), as llama-server lists them
    assert sorted(b["token"] for b in bias) == sorted(eng.tokenizer.eog_ids)
    assert all(b["bias"] is None for b in bias)
    plain = complete(server, n_predict=2, temperature=0)
    assert plain["generation_settings"]["logit_bias"] == []
    # a request's own bias stays next to the ban
    own = complete(server, n_predict=2, ignore_eos=True, logit_bias=[[42, 1.5]])
    assert {"bias": 1.5, "token": 42} in own["generation_settings"]["logit_bias"]


def test_a_plain_text_chat_template_renders_as_itself():
    # llama-server --jinja takes any --chat-template text as a template (its test passes
    # "This is not a chat template, it is"); a lone unknown word stays a typo'd name
    text = "This is not a chat template, it is"
    assert resolve_template_arg(text) == text
    msgs = [{"role": "user", "content": "What is the best book"}]
    assert build_prompt(ChatTemplate(resolve_template_arg(text)), msgs) == text
    with pytest.raises(ChatTemplateError, match="built-in"):
        resolve_template_arg("chatmll")
    assert parse_args(["--chat-template", text]).chat_template == text


def test_backend_sampling_is_accepted_with_a_note(capsys):
    for flag in ("-bs", "--backend-sampling", "--backend_sampling"):
        parse_args([flag])
        assert "ignored" in capsys.readouterr().err


def test_a_continued_message_joins_its_text_parts_with_a_blank_line():
    # llama.cpp's render_content of the continued message (test_chat_template_assistant
    # _prefill); the other messages' parts stay joined by one newline
    t = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": parts}]
    text = build_prompt(t, msgs)
    assert text.endswith("<|im_start|>assistant\nWh\n\nill")
    assert "<|im_start|>user\nWh\nill<|im_end|>" in text


def test_several_completions_carry_the_fields_of_one(server):
    base = {
        "prompt": "Once upon a time",
        "n_predict": 3,
        "temperature": 0,
        "n_probs": 2,
        "post_sampling_probs": True,
    }
    one = complete(server, **base)
    fields = ["content", "completion_probabilities", "prompt"]
    st, many = req(server, "POST", "/completion", {**base, "n_cmpl": 2, "response_fields": fields})
    assert st == 200 and len(many) == 2
    for r in many:
        assert set(r) == set(fields)  # response_fields applies to each result
        assert r["content"] == one["content"] and r["prompt"] == one["prompt"]
        got, want = r["completion_probabilities"], one["completion_probabilities"]
        assert [p["id"] for p in got] == [p["id"] for p in want]
        assert all("prob" in p and "top_probs" in p and "logprob" not in p for p in got)
    # streamed: each choice's token chunks carry their probabilities too
    events = sse_events(server, "/completion", {**base, "n_cmpl": 2, "stream": True})
    for i in (0, 1):
        probs = [p for e in events if e.get("index") == i and not e["stop"]
                 for p in e.get("completion_probabilities", [])]  # fmt: skip
        assert [p["id"] for p in probs] == [p["id"] for p in one["completion_probabilities"]]
        assert all("prob" in p for p in probs)


def test_stream_chunks_name_the_slot_they_run_in(server):
    """llama-server's stream chunks carry the slot's id_slot, not -1 (test_stream.py)."""
    events = sse_events(
        server,
        "/completion",
        {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0, "stream": True},
    )
    *tokens, last = events
    assert tokens and last["stop"] is True and last["id_slot"] == 0  # -np 1: slot 0
    assert [e["id_slot"] for e in tokens] == [0] * len(tokens)
