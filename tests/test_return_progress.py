"""``return_progress`` (issue #20) on a real server over real SmolLM2: a streaming
request gets llama-server's ``prompt_progress`` chunks during prefill (total, cache,
processed, time_ms), the first before anything is evaluated, the last with the whole
prompt in, all before the first token; in each endpoint's own chunk shape."""

from __future__ import annotations

import pytest
from test_logit_bias_and_n import sse_events

from core.http import ServerSettings, ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine

PROMPT = "Progress reports are sent while the prompt is read."


@pytest.fixture(scope="module")
def server(smollm_path):
    eng = Engine(EngineOptions(ctx_size=256, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    yield srv
    srv.stop()
    eng.stop()


def progress_of(events):
    """The prompt_progress objects, checking they all come before the first token."""
    marks = [e.get("prompt_progress") for e in events]
    seen = [i for i, m in enumerate(marks) if m is not None]
    assert seen == list(range(len(seen)))  # a prefix of the stream
    return [m for m in marks if m is not None], events[len(seen) :]


def check(progress, total, cache):
    first, last = progress[0], progress[-1]
    assert first["processed"] == first["cache"] == cache  # nothing evaluated yet
    assert last["processed"] == last["total"] == total
    assert all(p["total"] == total and p["cache"] == cache for p in progress)
    assert all(a["processed"] < b["processed"] for a, b in zip(progress, progress[1:]))
    assert all(p["time_ms"] >= 0 for p in progress)


def test_completion_reports_prompt_progress_then_uses_the_cache(server):
    body = {"prompt": PROMPT, "n_predict": 2, "stream": True, "return_progress": True}
    events = sse_events(server, "/completion", body)
    progress, rest = progress_of(events)
    total = rest[-1]["timings"]["prompt_n"]
    check(progress, total, cache=0)
    assert len(progress) == 2  # before, and after the one prompt chunk
    p0 = events[0]
    assert p0["content"] == "" and p0["tokens"] == [] and p0["stop"] is False
    assert p0["tokens_evaluated"] == total and p0["tokens_predicted"] == 0
    # the same prompt again: all but its last token come from the cache
    again, _ = progress_of(sse_events(server, "/completion", body))
    check(again, total, cache=total - 1)


def test_chat_and_openai_completions_carry_it_in_their_chunks(server):
    chat = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        "stream": True,
        "return_progress": True,
        "cache_prompt": False,
    }
    progress, _ = progress_of(sse_events(server, "/v1/chat/completions", chat)[1:])
    assert progress[-1]["processed"] == progress[-1]["total"] > 0
    events = sse_events(server, "/v1/chat/completions", chat)
    marked = [e for e in events if "prompt_progress" in e]
    assert marked and all(e["object"] == "chat.completion.chunk" for e in marked)
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in marked)
    cmpl = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "return_progress": True}
    marked = [e for e in sse_events(server, "/v1/completions", cmpl) if "prompt_progress" in e]
    assert marked and all(e["choices"][0]["text"] == "" for e in marked)


def test_without_return_progress_nothing_is_sent(server):
    body = {"prompt": PROMPT, "n_predict": 2, "stream": True}
    assert not any("prompt_progress" in e for e in sse_events(server, "/completion", body))


def test_timings_per_token_puts_the_timings_so_far_in_each_report(server):
    body = {
        "prompt": PROMPT,
        "n_predict": 2,
        "stream": True,
        "return_progress": True,
        "timings_per_token": True,
        "cache_prompt": False,
    }
    events = sse_events(server, "/completion", body)
    progress, rest = progress_of(events)
    first, last = events[0]["timings"], events[len(progress) - 1]["timings"]
    # before anything is evaluated every figure is 0, as llama-server's first report
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0
    assert first["predicted_n"] == 0 and first["predicted_ms"] == 0.0
    assert last["prompt_n"] == rest[-1]["timings"]["prompt_n"] and last["prompt_ms"] > 0
    assert all(
        v is not None and v >= 0 for e in events[: len(progress)] for v in e["timings"].values()
    )


def test_batch_size_flag_sets_the_prompt_chunk(smollm_path):
    """-b / -ub are llama-server's physical batch, min(-b, -ub): a prompt is evaluated
    in chunks of that many tokens, one progress report each (as upstream's
    test_return_progress counts them)."""
    from core.cli import parse_args

    args = parse_args(["--headless", "-m", str(smollm_path), "-b", "4", "-c", "256", "-np", "1"])
    eng = Engine(EngineOptions.from_args(args))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    try:
        body = {"prompt": PROMPT, "n_predict": 1, "stream": True, "return_progress": True}
        progress, rest = progress_of(sse_events(srv, "/completion", body))
        total = rest[-1]["timings"]["prompt_n"]
        assert total > 8  # three chunks of 4 at least
        check(progress, total, cache=0)
        done = [p["processed"] for p in progress[1:]]
        assert done == [min(total, 4 * (i + 1)) for i in range(-(-total // 4))]
    finally:
        srv.stop()
        eng.stop()
