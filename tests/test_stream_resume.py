"""Resumable streams (llama-server's X-Conversation-Id and /v1/stream routes): the
session rules on a fake clock, then a real server over real SmolLM2 with a real client
that goes away mid-stream."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from test_http_api import req

from core.http import streams as S
from tests.serving import running_engine, serving

# ---- the session rules ------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_session_keeps_at_most_its_cap_and_loses_older_offsets():
    s = S.StreamSession("c", max_bytes=10, now=0.0)
    s.append(b"0123456789")
    assert s.read(0) == b"0123456789" and s.read(4) == b"456789"
    s.append(b"abcd")  # 14 bytes in all: the first 4 go
    assert s.total_bytes == 14 and s.dropped_prefix == 4
    assert s.read(4) == b"456789abcd" and s.read(14) == b""
    with pytest.raises(S.OffsetLost):
        s.read(3)
    s.append(b"x" * 25)  # one chunk over the cap keeps its tail
    assert s.read(s.dropped_prefix) == b"x" * 10 and s.total_bytes == 39


def test_a_finished_session_takes_no_more_bytes_and_wakes_its_readers():
    async def go():
        s = S.StreamSession("c", 100, 0.0)
        waiting = asyncio.create_task(s.changed())
        await asyncio.sleep(0)
        assert not waiting.done()
        s.append(b"a")
        await asyncio.wait_for(waiting, 1)
        waiting = asyncio.create_task(s.changed())
        await asyncio.sleep(0)
        s.finalize(5.0)
        await asyncio.wait_for(waiting, 1)
        assert s.done and s.completed_at == 5.0 and not s.append(b"b")
        await asyncio.wait_for(s.changed(), 1)  # returns at once once done

    asyncio.run(go())


def test_one_live_session_per_id_and_finished_ones_expire():
    clock = Clock()
    m = S.StreamSessions(ttl_s=300, clock=clock)
    a = m.create_or_replace("conv")
    b = m.create_or_replace("conv")  # the same id again: the first is cancelled
    assert a.cancelled and a.done and not b.done and m.get("conv") is b
    m.finish(b)
    clock.t += 299
    assert m.get("conv") is b
    clock.t += 2
    assert m.get("conv") is None and len(m) == 0
    live = m.create_or_replace("live")
    clock.t += 10_000  # a live session never expires
    assert m.get("live") is live


def test_past_the_session_limit_the_oldest_finished_goes_first():
    clock = Clock()
    m = S.StreamSessions(max_sessions=3, clock=clock)
    live = m.create_or_replace("live")
    for name in ("old", "new"):
        clock.t += 1
        m.finish(m.create_or_replace(name))
    clock.t += 1
    m.create_or_replace("fourth")
    assert m.get("old") is None and m.get("new") is not None and m.get("live") is live
    assert not live.cancelled
    m.create_or_replace("fifth")  # new (finished) goes before the live one
    assert m.get("new") is None and m.get("live") is live


def test_lookup_answers_only_for_the_ids_named():
    m = S.StreamSessions(clock=Clock())
    m.create_or_replace("a")
    m.create_or_replace("a::org/model:Q8_0")
    m.create_or_replace("ab")
    got = m.lookup(["a"])
    assert sorted(x["conversation_id"] for x in got) == ["a", "a::org/model:Q8_0"]
    assert got[0].keys() == {
        "conversation_id",
        "is_done",
        "total_bytes",
        "started_at",
        "completed_at",
    }
    assert m.lookup([]) == [] and m.lookup(["zzz"]) == []


def test_conversation_ids_are_checked():
    assert S.conversation_id({}) is None
    assert S.conversation_id({"X-Conversation-Id": ""}) is None
    assert S.conversation_id({"X-Conversation-Id": "c::org/m"}) == "c::org/m"
    for bad in ("x" * (S.MAX_ID_CHARS + 1), "a\x01b"):
        with pytest.raises(ValueError):
            S.conversation_id({"X-Conversation-Id": bad})


# ---- on a real server -------------------------------------------------------------------

# a bug that leaves a session open would hang a replay: every client call is bounded
TIMEOUT = aiohttp.ClientTimeout(total=90)
CONV = "conv-test::ggml-org/tinygemma3-GGUF:Q8_0"  # slashes travel in the query string


@pytest.fixture(scope="module")
def eng(smollm_path):
    with running_engine(smollm_path, ctx_size=512, n_parallel=2) as e:
        yield e


@pytest.fixture(scope="module")
def server(eng):
    with serving(eng) as srv:
        yield srv


def body(n_predict, **extra):
    return {
        "messages": [{"role": "user", "content": "Tell me a story about a river."}],
        "stream": True,
        "max_tokens": n_predict,
        "temperature": 0,
        **extra,
    }


def content_of(raw: bytes) -> str:
    text = ""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                text += c.get("delta", {}).get("content") or ""
    return text


async def stream_all(srv, payload, conv=None, stop_after=None):
    """The raw SSE bytes of one streamed chat (``stop_after`` bytes: then hang up)."""
    headers = {"X-Conversation-Id": conv} if conv else {}
    got = b""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(srv.url + "/v1/chat/completions", json=payload, headers=headers) as r:
            assert r.status == 200, await r.text()
            async for chunk in r.content.iter_any():
                got += chunk
                if stop_after is not None and len(got) >= stop_after:
                    break
    return got


async def replay(srv, conv, offset=0):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        q = {"conv_id": conv, "from": str(offset)}
        async with s.get(srv.url + "/v1/stream", params=q) as r:
            return r.status, await r.read()


async def delete(srv, conv):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.delete(srv.url + "/v1/stream", params={"conv_id": conv}) as r:
            return r.status


def wait_idle(eng, timeout=60.0):
    async def go():
        for _ in range(int(timeout / 0.05)):
            if eng.stats()["active"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    return asyncio.run(go())


def test_a_finished_stream_replays_byte_for_byte_and_a_stop_forgets_it(server, eng):
    async def go():
        sent = await stream_all(server, body(12), CONV)
        assert sent.rstrip().endswith(b"data: [DONE]")
        st, again = await replay(server, CONV)
        assert st == 200 and again == sent
        st, tail = await replay(server, CONV, 10)
        assert st == 200 and tail == sent[10:]
        assert await delete(server, CONV) == 204
        assert (await replay(server, CONV))[0] == 404
        assert await delete(server, CONV) == 204  # idempotent, as llama-server's

    asyncio.run(go())


def test_the_generation_outlives_its_client_and_the_replay_follows_it_live(server, eng):
    async def go():
        whole = await stream_all(server, body(48))  # the same request, never dropped
        conv = "dropped-client"
        part = await stream_all(server, body(48), conv, stop_after=200)
        assert not part.rstrip().endswith(b"data: [DONE]")
        st, replayed = await replay(server, conv)  # follows the live bytes to the end
        assert st == 200 and replayed.startswith(part)
        assert replayed.rstrip().endswith(b"data: [DONE]")
        assert content_of(replayed) == content_of(whole) != ""
        await delete(server, conv)

    asyncio.run(go())
    assert wait_idle(eng)


def test_a_stop_cancels_the_live_generation_and_frees_its_slot(server, eng):
    async def go():
        conv = "stopped"
        client = asyncio.create_task(
            stream_all(server, body(400, ignore_eos=True), conv)  # ~400 tokens: seconds
        )
        for _ in range(400):  # until the first bytes are in the session
            st, got = await replay_now(server, conv)
            if st == 200 and got:
                break
            await asyncio.sleep(0.05)
        assert await delete(server, conv) == 204
        sent = await asyncio.wait_for(client, 60)  # the client's stream ends, cut short
        assert content_of(sent).count(" ") < 300
        assert (await replay(server, conv))[0] == 404

    async def replay_now(srv, conv):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(
                srv.url + "/v1/streams/lookup", json={"conversation_ids": [conv]}
            ) as r:
                found = await r.json()
        return (200, found[0]["total_bytes"]) if found else (404, 0)

    asyncio.run(go())
    assert wait_idle(eng)


def test_the_same_id_again_cancels_the_first_generation(server, eng):
    async def go():
        conv = "replaced"
        first = asyncio.create_task(stream_all(server, body(400, ignore_eos=True), conv))
        await asyncio.sleep(1.0)
        second = await stream_all(server, body(8), conv)
        cut = await asyncio.wait_for(first, 60)
        assert not cut.rstrip().endswith(b"data: [DONE]")  # cut short, not finished
        st, replayed = await replay(server, conv)
        assert st == 200 and replayed == second
        await delete(server, conv)

    asyncio.run(go())
    assert wait_idle(eng)


def test_without_an_id_a_gone_client_still_cancels_its_generation(server, eng):
    asyncio.run(stream_all(server, body(400, ignore_eos=True), stop_after=200))
    assert wait_idle(eng, timeout=10)


def test_bad_requests_to_the_stream_routes_are_clear_400s(server, eng):
    assert req(server, "GET", "/v1/stream")[0] == 400
    assert req(server, "DELETE", "/v1/stream")[0] == 400
    st, out = req(server, "GET", "/v1/stream?conv_id=nobody")
    assert st == 404 and out["error"]["message"] == "Stream not found or expired"
    asyncio.run(stream_all(server, body(4), "bad-offsets"))
    for bad in ("-1", "x", "1e3", "9" * 40):
        st, out = req(server, "GET", f"/v1/stream?conv_id=bad-offsets&from={bad}")
        assert st == 400 and "offset" in out["error"]["message"], bad
    req(server, "DELETE", "/v1/stream?conv_id=bad-offsets")
    st, out = req(
        server,
        "POST",
        "/v1/chat/completions",
        body(400, ignore_eos=True),
        headers={"X-Conversation-Id": "x" * 600},
    )
    assert st == 400 and "X-Conversation-Id" in out["error"]["message"]
    assert wait_idle(eng, timeout=10)  # refused before it ran
    for junk in ({"conversation_ids": "a"}, {"conversation_ids": [1, None, ""]}, {}):
        assert req(server, "POST", "/v1/streams/lookup", junk) == (200, [])
    assert req(server, "POST", "/v1/streams/lookup", raw=b"{not json")[0] == 400
