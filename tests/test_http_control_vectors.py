"""Control vectors over HTTP on a real server (127.0.0.1): GET/POST /control-vectors
shaped like /lora-adapters, the per-request "control_vectors" field on /completion and
the OpenAI routes, /props and /slots, and runtime load/unload behind the adapters'
opt-in and folder policy. The tokens are llama-server's own
(tests/data/llamacpp/smollm2_f32_control_vectors.json)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from serving import running_engine, serving
from test_http_api import req

CASES = "smollm2_f32_control_vectors.json"


@pytest.fixture(scope="module")
def cv_ref(ref_dir) -> dict:
    return json.loads((ref_dir / CASES).read_text())


@pytest.fixture(scope="module")
def vec_dir(ref_dir, tmp_path_factory):
    """A --lora-dir folder holding the reference vectors (runtime loads come from it)."""
    d = tmp_path_factory.mktemp("vectors")
    for name in ("cv_a.gguf", "cv_b.gguf"):
        shutil.copy(ref_dir / "control_vectors" / name, d / name)
    return d


@pytest.fixture(scope="module")
def engine(smollm_path, vec_dir):
    # --control-vector-scaled cv_a.gguf:0.8 at start, as llama-server's "one" case
    with running_engine(
        smollm_path,
        ctx_size=256,
        n_parallel=2,
        control_vectors=((str(vec_dir / "cv_a.gguf"), 0.8),),
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine, vec_dir):
    with serving(engine, allow_runtime_lora=True, lora_dirs=[vec_dir]) as srv:
        yield srv


def case(cv_ref, name, i=0):
    return [c for c in cv_ref["greedy"] if c["case"] == name][i]


def body(c, **extra):
    return {"prompt": c["prompt_tokens"], "n_predict": 16, "temperature": 0,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False, **extra}  # fmt: skip


def test_get_lists_the_startup_vector(server, vec_dir):
    st, out = req(server, "GET", "/control-vectors")
    assert st == 200
    assert [(v["id"], v["path"], v["scale"], v["name"]) for v in out] == [
        (0, str(vec_dir / "cv_a.gguf"), 0.8, "cv_a")
    ]
    assert out[0]["layers"] == list(range(1, 30))


def test_completion_runs_under_the_global_vector_and_per_request_vectors(server, cv_ref):
    one = case(cv_ref, "one")
    st, out = req(server, "POST", "/completion", body(one))
    assert st == 200 and out["tokens"] == one["tokens"]  # the startup vector applies
    st, out = req(server, "POST", "/completion", body(one, control_vectors=[]))
    assert st == 200 and out["tokens"] != one["tokens"]  # [] : no vector
    st, loaded = req(server, "POST", "/control-vectors/load", {"path": "cv_b.gguf", "scale": 0})
    assert st == 200 and loaded["id"] == 1 and loaded["scale"] == 0
    try:
        plain = case(cv_ref, "plain")
        st, out = req(
            server, "POST", "/completion", body(plain, control_vectors=[{"id": 1, "scale": 1.0}])
        )
        assert st == 200 and out["tokens"] == plain["tokens"]  # a off (unlisted), b at 1
        # the OpenAI route takes the same field
        st, out = req(
            server,
            "POST",
            "/v1/completions",
            {
                "prompt": plain["prompt_tokens"],
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "control_vectors": [{"id": 1}],
            },  # fmt: skip
        )
        assert st == 200
        text = out["choices"][0]["text"]
        st, detok = req(server, "POST", "/detokenize", {"tokens": plain["tokens"]})
        assert text == detok["content"]
    finally:
        st, _ = req(server, "POST", "/control-vectors/unload", {"id": 1})
        assert st == 200
    st, out = req(server, "GET", "/control-vectors")
    assert [v["id"] for v in out] == [0]


def test_post_sets_the_global_scales_and_props_show_them(server, cv_ref, engine):
    one = case(cv_ref, "one")
    try:
        st, out = req(server, "POST", "/control-vectors", [{"id": 0, "scale": 0.0}])
        assert st == 200 and out == {"success": True}
        st, props = req(server, "GET", "/props")
        assert props["control_vectors"][0]["scale"] == 0.0
        assert props["control_vector_layer_range"] == [-1, -1]
        st, out = req(server, "POST", "/completion", body(one))
        assert out["tokens"] != one["tokens"]  # the vector is off now
    finally:
        req(server, "POST", "/control-vectors", [{"id": 0, "scale": 0.8}])
    st, out = req(server, "POST", "/completion", body(one))
    assert out["tokens"] == one["tokens"]


@pytest.mark.parametrize(
    "bad",
    [
        {"id": 0, "scale": "big"},
        [{"id": 7, "scale": 1.0}],
        [{"id": 0, "scale": float("1e9")}],
        [{"id": True}],
        [{"scale": 1.0}],
    ],
)
def test_bad_bodies_are_400_and_change_nothing(server, bad):
    st, before = req(server, "GET", "/control-vectors")
    st, out = req(server, "POST", "/control-vectors", bad)
    assert st == 400 and "error" in out
    st, out = req(server, "POST", "/completion", {"prompt": "hi", "n_predict": 1,
                                                  "control_vectors": bad})  # fmt: skip
    assert st == 400 and "error" in out
    assert req(server, "GET", "/control-vectors")[1] == before


def test_slots_show_the_vectors_a_slot_ran_under(server, cv_ref):
    one = case(cv_ref, "one")
    st, _ = req(server, "POST", "/completion", body(one, id_slot=1))
    assert st == 200
    st, slots = req(server, "GET", "/slots")
    assert slots[1]["control_vectors"] == [{"id": 0, "scale": 0.8}]


def test_runtime_load_obeys_the_adapters_policy(server, engine, vec_dir, tmp_path):
    before = engine.control_vectors()
    outside = tmp_path / "cv.gguf"
    shutil.copy(vec_dir / "cv_a.gguf", outside)
    st, out = req(server, "POST", "/control-vectors/load", {"path": str(outside)})
    assert st in (400, 403) and "error" in out
    bad = vec_dir / "wrong.gguf"
    import gguf

    w = gguf.GGUFWriter(str(bad), "controlvector")
    w.add_tensor("direction.1", np.zeros(100, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st, out = req(server, "POST", "/control-vectors/load", {"path": "wrong.gguf"})
    assert st == 400 and "embedding size is 576" in out["error"]["message"]
    st, out = req(server, "POST", "/control-vectors/unload", {"id": 99})
    assert st == 400
    assert engine.control_vectors() == before


def test_runtime_load_is_off_without_the_flag(engine, vec_dir):
    with serving(engine) as srv:
        st, out = req(srv, "POST", "/control-vectors/load", {"path": "cv_b.gguf"})
        assert st == 403 and out["error"]["type"] == "permission_error"
        st, out = req(srv, "GET", "/control-vectors")
        assert st == 200 and len(out) == 1


def test_concurrent_requests_with_different_vectors_each_get_their_own(server, engine, cv_ref):
    """Two requests at once (-np 2: one batch), one under the global vector a, one with
    "control_vectors": [] (no vector): each gets exactly its own tokens."""
    import asyncio

    from test_http_api import call

    one = case(cv_ref, "one", 1)
    st, alone = req(server, "POST", "/completion", body(one, control_vectors=[]))
    steps0 = engine.stats()["steps"]

    async def both():
        return await asyncio.gather(
            call(server, "POST", "/completion", body(one)),
            call(server, "POST", "/completion", body(one, control_vectors=[])),
        )

    (s1, a), (s2, b) = asyncio.run(both())
    assert s1 == s2 == 200
    assert a["tokens"] == one["tokens"] and b["tokens"] == alone["tokens"]
    assert a["tokens"] != b["tokens"]
    assert engine.stats()["steps"] - steps0 < 2 * 16  # decoded side by side


def test_a_slot_computed_under_vectors_is_not_saved(engine, cv_ref, tmp_path):
    """The slot file records adapters only: restored, a steered slot's KV would serve
    requests without the vector, so saving it is a 400 (and an unsteered slot saves)."""
    one = case(cv_ref, "one")
    with serving(engine, slot_save_path=tmp_path) as srv:
        st, _ = req(srv, "POST", "/completion", body(one, id_slot=0, cache_prompt=True))
        assert st == 200
        st, out = req(srv, "POST", "/slots/0?action=save", {"filename": "steered"})
        assert st == 400 and "control vectors" in out["error"]["message"]
        assert not (tmp_path / "steered").exists()
        st, _ = req(
            srv, "POST", "/completion", body(one, id_slot=0, cache_prompt=True, control_vectors=[])
        )
        st, out = req(srv, "POST", "/slots/0?action=save", {"filename": "plain"})
        assert st == 200
