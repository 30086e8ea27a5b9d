"""POST /control-vectors/train on a real server (127.0.0.1): a tiny vector made from
one pair, written into the data dir and loaded as a new vector that then steers a
request; the opt-in (--allow-runtime-lora) and every kind of bad body, each a 4xx
with nothing changed; a client that hangs up mid-training cancels it."""

from __future__ import annotations

import numpy as np
import pytest
from serving import hold_training, running_engine, serving
from test_http_api import req

from core.http import adapters as adapters_http
from core.lora.control import load_control_vector
from core.paths import data_dir

TINY = {"pairs": [{"positive": "Be happy.", "negative": "Be sad."}], "suffixes": [""]}


@pytest.fixture(scope="module")
def engine(smollm_path):
    with running_engine(smollm_path, ctx_size=256, n_parallel=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine, allow_runtime_lora=True) as srv:
        yield srv


def test_train_writes_loads_and_steers(server, engine):
    body = {**TINY, "method": "mean", "name": "tiny-happy", "load": True, "scale": 0,
            "layers": [2, 12]}  # fmt: skip
    st, out = req(server, "POST", "/control-vectors/train", body)
    assert st == 200, out
    path = data_dir() / "adapters" / "tiny-happy.gguf"
    assert out["path"] == str(path) and out["examples"] == 1 and out["method"] == "mean"
    assert out["vector"]["name"] == "tiny-happy" and out["vector"]["scale"] == 0
    assert out["vector"]["layers"] == list(range(2, 13))
    assert load_control_vector(path, engine.config).layers == tuple(range(2, 13))
    st, listed = req(server, "GET", "/control-vectors")
    assert [v["id"] for v in listed] == [out["vector"]["id"]]
    # the new vector steers a request that names it; at scale 0 (global) nothing changes
    prompt = {"prompt": "My day was", "n_predict": 8, "temperature": 0, "return_tokens": True}
    _, plain = req(server, "POST", "/completion", prompt)
    vid = out["vector"]["id"]
    _, steered = req(
        server, "POST", "/completion", {**prompt, "control_vectors": [{"id": vid, "scale": 4}]}
    )
    assert steered["tokens"] != plain["tokens"]
    # the same name again: a 409, the file as it was
    before = path.read_bytes()
    st, err = req(server, "POST", "/control-vectors/train", body)
    assert st == 409 and "exists already" in err["error"]["message"]
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "body, match",
    [
        ({}, "no pairs"),
        ({"pairs": []}, "no pairs"),
        ({"pairs": [{"positive": "", "negative": "b"}]}, "must not be empty"),
        ({**TINY, "method": "ica"}, "method must be one of pca, mean"),
        ({"pairs": TINY["pairs"] * 65}, "at most 64"),
        ({"pairs": [{"positive": "a" * 1001, "negative": "b"}]}, "characters"),
        ({**TINY, "name": "../evil"}, "name must be"),
        ({**TINY, "template": "nope"}, "template must be one of"),
        ({**TINY, "load": "yes"}, "load must be a boolean"),
        ({**TINY, "load": True, "scale": 1e9}, "finite number"),
        ({**TINY, "layers": [5, 40]}, "layers 5..40"),
        ({**TINY, "bogus": 1}, "unknown field 'bogus'"),
    ],
)
def test_bad_bodies_are_400_and_nothing_changes(server, body, match):
    before = sorted(p.name for p in (data_dir() / "adapters").glob("*"))
    _, vectors = req(server, "GET", "/control-vectors")
    st, err = req(server, "POST", "/control-vectors/train", body)
    assert st == 400 and match in err["error"]["message"], err
    assert sorted(p.name for p in (data_dir() / "adapters").glob("*")) == before
    assert req(server, "GET", "/control-vectors")[1] == vectors


def test_training_needs_runtime_lora(engine):
    with serving(engine) as srv:
        st, err = req(srv, "POST", "/control-vectors/train", {**TINY, "name": "nope"})
    assert st == 403 and "allow-runtime-lora" in err["error"]["message"]
    assert not (data_dir() / "adapters" / "nope.gguf").exists()


def test_template_pairs_build_prompts_the_model_takes(engine):
    """A built-in template's every prompt fits the prompt cap with SmolLM2's template."""
    from core.lora.vector_train import MAX_PROMPT_TOKENS, engine_render, example_prompts, make_spec

    ex = example_prompts(make_spec(template="happy-sad"), engine_render(engine))
    assert max(len(t) for pair in ex for t in pair) < MAX_PROMPT_TOKENS
    assert all(p != n for p, n in ex)
    assert np.mean([len(p) for p, _ in ex]) > 10


def test_requests_are_served_while_a_vector_is_made(server, monkeypatch):
    """Training runs its forwards between the scheduler's steps: with the training held
    between two pairs (on its own thread, the engine free), a completion is answered
    and a second training is refused as busy (503) rather than queued; then the first
    one finishes. Held by an event, not raced against a clock."""
    import threading

    held, release, _ = hold_training(monkeypatch, after=1)
    ended = {}
    body = {"pairs": TINY["pairs"], "suffixes": ["", "I", "Well,"], "name": "busy-one"}
    t = threading.Thread(
        target=lambda: ended.setdefault(
            "train", req(server, "POST", "/control-vectors/train", body)
        )
    )
    t.start()
    try:
        assert held.wait(120)  # the training is under way, between two pairs
        st, busy = req(server, "POST", "/control-vectors/train", {**TINY, "name": "busy-two"})
        got = req(server, "POST", "/completion", {"prompt": "Hello", "n_predict": 2})
        assert "train" not in ended  # answered while the training is still running
    finally:
        release.set()
        t.join(120)
    tst, out = ended["train"]
    assert tst == 200 and out["examples"] == 3
    assert got[0] == 200
    assert st == 503 and "busy" in busy["error"]["message"]
    assert not (data_dir() / "adapters" / "busy-two.gguf").exists()


@pytest.mark.parametrize("hold_after", [1, 3], ids=["between-pairs", "after-the-last-pair"])
def test_a_client_that_disconnects_cancels_the_training(engine, monkeypatch, hold_after):
    """A client that hangs up while its vector is being made cancels the training, also
    when it goes during the last pair (nothing left to train, the file and the load to
    come): the training ends with TrainCancelled, no file is written, nothing is
    registered and the engine goes on serving. Held by events, not clocks: the training
    waits after pair ``hold_after`` of 3 until the server has logged the request as 499
    (its handler has seen the client go), then is let go."""
    import asyncio
    import threading

    import aiohttp

    from core.lora import vector_train

    held, release, outcome = hold_training(monkeypatch, after=hold_after)
    ended = threading.Event()
    gone = threading.Event()  # the request log's "499 (client disconnected)" line

    def on_log(line: str) -> None:
        if "/control-vectors/train 499" in line:
            gone.set()

    real_and_load = adapters_http._train_and_load

    def train_and_load(*args):
        try:
            out = real_and_load(*args)
            outcome["out"] = out
            return out
        except BaseException as e:
            outcome.setdefault("error", e)
            raise
        finally:
            ended.set()  # the training's thread is done: written, loaded or not

    monkeypatch.setattr(adapters_http, "_train_and_load", train_and_load)
    name = f"hung-up-{hold_after}"
    body = {"pairs": TINY["pairs"], "suffixes": ["", "I", "Well,"], "name": name,
            "load": True}  # fmt: skip

    async def post_then_hang_up(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(url + "/control-vectors/train", json=body))
            assert await asyncio.to_thread(held.wait, 120)  # the training is under way
            task.cancel()  # the client goes: its connection is closed
            with pytest.raises(asyncio.CancelledError):
                await task

    with serving(engine, allow_runtime_lora=True, on_log=on_log) as srv:
        _, vectors = req(srv, "GET", "/control-vectors")
        try:
            asyncio.run(post_then_hang_up(srv.url))
            assert gone.wait(60)  # the server saw the client go
        finally:
            release.set()
        assert ended.wait(120)
        assert isinstance(outcome.get("error"), vector_train.TrainCancelled), outcome
        assert not (data_dir() / "adapters" / f"{name}.gguf").exists()
        assert req(srv, "GET", "/control-vectors") == (200, vectors)  # nothing registered
        st, out = req(srv, "POST", "/completion", {"prompt": "Hello", "n_predict": 2})
        assert st == 200 and out["tokens_predicted"] == 2
