"""POST /control-vectors/train on a real server (127.0.0.1): a tiny vector made from
one pair, written into the data dir and loaded as a new vector that then steers a
request; the opt-in (--allow-runtime-lora) and every kind of bad body, each a 4xx
with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
from serving import running_engine, serving
from test_http_api import req

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


def test_requests_are_served_while_a_vector_is_made(server):
    """Training runs its forwards between the scheduler's steps: a completion sent
    while a 24-example training runs is answered before the training ends, and a
    second training at once is refused as busy (503) rather than queued."""
    import threading
    import time

    ended = {}

    # 24 examples, one pair's forwards per engine turn: a 2-token completion is served
    # between two of them, long before the last. (With 3 the completion could queue
    # behind the whole training on a busy CI machine, and did, by 52 ms.)
    suffixes = [f"{i}." for i in range(24)]

    def train():
        body = {"pairs": TINY["pairs"], "suffixes": suffixes, "name": "busy-one"}
        ended["train"] = (req(server, "POST", "/control-vectors/train", body), time.monotonic())

    t = threading.Thread(target=train)
    t.start()
    time.sleep(0.3)  # the training is under way
    st, busy = req(server, "POST", "/control-vectors/train", {**TINY, "name": "busy-two"})
    prompt = {"prompt": "Hello", "n_predict": 2, "temperature": 0}
    got = req(server, "POST", "/completion", prompt)
    answered = time.monotonic()
    t.join(120)
    (tst, out), train_end = ended["train"]
    assert tst == 200 and out["examples"] == len(suffixes)
    assert got[0] == 200 and answered < train_end
    assert st == 503 and "busy" in busy["error"]["message"]
    assert not (data_dir() / "adapters" / "busy-two.gguf").exists()
