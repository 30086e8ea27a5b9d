"""Slot save / restore / erase (llama-server's POST /slots/{id}?action=..., issue #20) on
a real server over real SmolLM2: a saved slot restored into another slot serves the
same prompt from its keys/values (one token of prefill, the same greedy text), and
hostile names, slots and files are a clear 400 while the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from test_http_api import req
from tiny_gguf import write_tiny_llama

from core.gguf.reader import GGUFFile
from core.http import ServerSettings, ServerThread
from core.model.config import ModelConfig
from core.options import EngineOptions
from core.serve import slots
from core.serve.engine import Engine

PROMPT = "The capital of France is a city called"


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slot_saves")


@pytest.fixture(scope="module")
def server(smollm_path, save_dir):
    eng = Engine(EngineOptions(ctx_size=256, n_parallel=2))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, slot_save_path=save_dir)).start()
    yield srv
    srv.stop()
    eng.stop()


def complete(server, prompt, id_slot, n=6):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True}
    st, out = req(server, "POST", "/completion", {**body, "id_slot": id_slot})
    assert st == 200, out
    return out


def test_a_restored_slot_serves_its_prompt_from_the_file(server, save_dir):
    first = complete(server, PROMPT, id_slot=1)
    assert first["id_slot"] == 1
    n_prompt = first["timings"]["prompt_n"]
    st, saved = req(server, "POST", "/slots/1?action=save", {"filename": "fr.bin"})
    assert st == 200, saved
    # the slot holds the prompt and every generated token but the last (never run)
    assert saved["id_slot"] == 1 and saved["filename"] == "fr.bin"
    assert saved["n_saved"] == n_prompt + 6 - 1
    assert saved["n_written"] == (save_dir / "fr.bin").stat().st_size
    assert saved["timings"]["save_ms"] >= 0
    # slot 1 forgets it: no cached copy of it is left anywhere
    st, erased = req(server, "POST", "/slots/1?action=erase")
    assert st == 200 and erased == {"id_slot": 1, "n_erased": saved["n_saved"]}

    st, restored = req(server, "POST", "/slots/0?action=restore", {"filename": "fr.bin"})
    assert st == 200, restored
    assert restored["n_restored"] == saved["n_saved"]
    assert restored["n_read"] == saved["n_written"]
    again = complete(server, PROMPT, id_slot=0)
    assert again["id_slot"] == 0
    # only the last prompt token is recomputed (its logits are needed), and the
    # restored keys/values give exactly the text of the first run
    assert again["timings"]["cache_n"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert again["content"] == first["content"]


def test_erase_makes_the_next_request_prefill_everything(server):
    first = complete(server, "Erase me, then run me again", id_slot=1, n=2)
    st, out = req(server, "POST", "/slots/1?action=erase")
    assert st == 200 and out["n_erased"] == first["timings"]["prompt_n"] + 1
    again = complete(server, "Erase me, then run me again", id_slot=1, n=2)
    assert again["timings"]["cache_n"] == 0
    assert again["timings"]["prompt_n"] == first["timings"]["prompt_n"]


def test_slots_show_the_last_request_of_each_slot(server):
    out = complete(server, "Show me in slots", id_slot=1, n=3)
    st, listed = req(server, "GET", "/slots")
    assert st == 200
    s1 = listed[1]
    assert s1["id"] == 1 and s1["is_processing"] is False
    assert s1["n_prompt_tokens"] == out["tokens_evaluated"]
    # an idle slot keeps no budget of its finished request (llama-server's shape)
    assert s1["next_token"] == [
        {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    ]


@pytest.mark.parametrize(
    "name", ["../escape.bin", "a/b.bin", "..", "", "x:y", "trailing.", " lead", "a\\b", 7]
)
def test_hostile_filenames_are_refused(server, save_dir, name):
    for action in ("save", "restore"):
        st, out = req(server, "POST", f"/slots/0?action={action}", {"filename": name})
        assert st == 400, (action, name, out)
        assert "filename" in out["error"]["message"].lower()
    assert not (save_dir.parent / "escape.bin").exists()


@pytest.mark.parametrize("slot", ["2", "-1", "abc", "99999999999999999999"])
def test_a_slot_out_of_range_is_refused(server, slot):
    st, out = req(server, "POST", f"/slots/{slot}?action=erase")
    assert st == 400 and "Invalid slot ID" in out["error"]["message"]


def test_bad_files_are_refused_and_the_server_keeps_serving(server, save_dir, tmp_path):
    complete(server, "Something to save", id_slot=0, n=2)
    st, _ = req(server, "POST", "/slots/0?action=save", {"filename": "good.bin"})
    assert st == 200
    good = (save_dir / "good.bin").read_bytes()
    # a file of another (tiny random) model, in every other respect valid
    other = tmp_path / "other.gguf"
    write_tiny_llama(other)
    cfg = ModelConfig.from_metadata(GGUFFile(other).metadata)
    img = slots.SlotImage(
        [1, 2], *[np.zeros((cfg.n_layers, cfg.n_kv_heads, 2, cfg.head_dim))] * 2, ()
    )
    slots.write_file(save_dir / "other.bin", slots.model_identity(other, cfg), [], img)
    cases = {
        "missing.bin": (None, "no slot save file"),
        "other.bin": (None, "another model"),
        "noise.bin": (np.random.default_rng(0).bytes(4096), "not a valid"),
        "short.bin": (good[: len(good) // 2], "truncated or corrupt"),
        "empty.bin": (b"", "too short"),
        "nan.bin": (good[:-8] + np.float32([np.nan, np.nan]).tobytes(), "not finite"),
    }
    for name, (data, why) in cases.items():
        if data is not None:
            (save_dir / name).write_bytes(data)
        st, out = req(server, "POST", "/slots/1?action=restore", {"filename": name})
        assert st == 400 and why in out["error"]["message"], (name, out)
    st, out = req(server, "POST", "/slots/1?action=restore", {})
    assert st == 400 and "filename" in out["error"]["message"]
    # the server still serves, and a good file still restores
    st, out = req(server, "POST", "/slots/1?action=restore", {"filename": "good.bin"})
    assert st == 200 and out["n_restored"] > 0
    complete(server, "Still alive?", id_slot=1, n=2)
    st, health = req(server, "GET", "/health")
    assert st == 200 and health["status"] == "ok"


def test_without_slot_save_path_actions_answer_501(smollm_path):
    eng = Engine(EngineOptions(ctx_size=128, n_parallel=1))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0)).start()
    try:
        st, out = req(srv, "POST", "/slots/0?action=save", {"filename": "x.bin"})
        assert st == 501 and "--slot-save-path" in out["error"]["message"]
    finally:
        srv.stop()
        eng.stop()


async def _save_while_busy(srv, n_predict):
    """Start a streamed request in slot 1, ask to save slot 1 once its first token has
    arrived (the slot is busy), finish reading the stream; the save's answer."""
    import asyncio
    import json

    import aiohttp

    body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            srv.url + "/completion", json={**body, "id_slot": 1, "stream": True}
        ) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            save = asyncio.create_task(
                s.post(srv.url + "/slots/1?action=save", json={"filename": "busy.bin"})
            )
            last = None
            async for line in r.content:
                if line.startswith(b"data: "):
                    last = json.loads(line[6:])
        resp = await save
        return resp.status, await resp.json(), last


def test_saving_a_busy_slot_waits_for_its_request(server):
    """llama-server defers a slot action until the slot is idle: the save holds the
    whole request, never a half-written slot, and is not refused."""
    import asyncio

    st, saved, last = asyncio.run(_save_while_busy(server, n_predict=24))
    assert last["stop"] is True and last["id_slot"] == 1
    assert st == 200, saved
    assert saved["n_saved"] == last["tokens_evaluated"] + 24 - 1


def test_a_slot_busy_past_the_wait_is_409(smollm_path, tmp_path):
    import asyncio

    eng = Engine(EngineOptions(ctx_size=256, n_parallel=2))
    eng.load_model(smollm_path)
    eng.start()
    srv = ServerThread(eng, ServerSettings(port=0, slot_save_path=tmp_path, slot_wait=0.0)).start()
    try:
        st, out, last = asyncio.run(_save_while_busy(srv, n_predict=24))
        assert st == 409 and "processing a request" in out["error"]["message"]
        assert last["stop"] is True  # the request itself ran to its end
        complete(srv, "Still alive?", id_slot=1, n=2)
    finally:
        srv.stop()
        eng.stop()


def test_a_failed_save_keeps_the_old_file_and_leaves_no_partial_one(tmp_path):
    """A save that fails half-way (here the V cache cannot be written; on a user's
    machine, a full disk) must leave the earlier save under that name untouched and no
    temporary file beside it."""
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model)
    cfg = ModelConfig.from_metadata(GGUFFile(model).metadata)
    ident = slots.model_identity(model, cfg)
    shape = (cfg.n_layers, cfg.n_kv_heads, 2, cfg.head_dim)
    saves = tmp_path / "saves"
    saves.mkdir()
    dest = saves / "s.bin"
    slots.write_file(dest, ident, [], slots.SlotImage([1, 2], np.ones(shape), np.ones(shape), ()))
    before = dest.read_bytes()
    ragged = [[1.0], [1.0, 2.0]]  # not an array: fails after the header and K are written
    with pytest.raises(ValueError):
        slots.write_file(dest, ident, [], slots.SlotImage([1, 2], np.ones(shape), ragged, ()))
    assert dest.read_bytes() == before
    assert sorted(p.name for p in saves.iterdir()) == ["s.bin"]
