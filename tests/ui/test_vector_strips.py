"""#37 item 2: control vectors are channels on the desk. A vector the engine has (loaded
by flag, over HTTP or by File ▸ New control vector) gets a strip marked "vec"; its
fader sets the engine's vector scale, mute/solo work across adapters and vectors, undo
and presets carry it, a chat reply and an A/B side run under it. aLoRA strips are
marked "aLoRA" with their invocation text visible in the tooltip."""

from __future__ import annotations

import pytest

from core.serve.sampling import SamplingParams
from ui.compare import BASE
from ui.desk import VecKey, key_mix, mix_label
from ui.strip import VectorStrip, visible

GREEDY = SamplingParams(temperature=0.0, n_predict=4, seed=1)
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def vec_dir(ref_dir):
    return ref_dir / "control_vectors"


def add_vector(window, qtbot, path, scale=0.0) -> VectorStrip:
    vid = window.engine.add_control_vector(path, scale)  # as the flag, HTTP, the dialog do
    qtbot.waitUntil(lambda: VecKey(vid) in window.mixer.strips, timeout=5000)
    return window.mixer.strips[VecKey(vid)]


def engine_vectors(window) -> dict[int, float]:
    return {v["id"]: v["scale"] for v in window.engine.control_vectors()}


def test_a_vector_the_engine_loads_gets_a_marked_strip_whose_fader_steers(window, qtbot, vec_dir):
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf", 0.25)
    vid = strip.info["vid"]
    assert strip.value == 0.25  # the scale it was loaded with
    assert strip.name.full_text == "cv_a" and strip.name.font().italic()
    assert strip.name.toolTip().startswith("Control vector: adds scale × direction to layers")
    assert strip.eff.text() == "vec"  # its tag, not an effective scale
    assert "layers 1–29" in strip.eff.toolTip()
    assert not strip.meter.isHidden()  # metered like an adapter (tests/ui/test_meters_desk.py)
    strip.spin.setValue(0.8)
    assert engine_vectors(window) == {vid: 0.8}
    assert window.mixer.desk_mix().vectors == {vid: 0.8}
    # rescaled from outside (HTTP): the fader follows, and that is no undo step
    steps = len(window.mixer.steps.undo_steps)
    window.engine.set_control_vectors({vid: -0.5})
    qtbot.waitUntil(lambda: strip.value == -0.5, timeout=5000)
    assert len(window.mixer.steps.undo_steps) == steps
    window.engine.remove_control_vector(vid)
    qtbot.waitUntil(lambda: VecKey(vid) not in window.mixer.strips, timeout=5000)


def test_mute_and_solo_work_across_adapters_and_vectors_and_undo_restores(loaded, qtbot, vec_dir):
    w, m = loaded, loaded.mixer
    strip = add_vector(w, qtbot, vec_dir / "cv_a.gguf")
    vid = strip.info["vid"]
    attn = m.strips[w.ids["lora_attn"]]
    attn.spin.setValue(1.0)
    strip.spin.setValue(0.6)
    assert engine_vectors(w) == {vid: 0.6} and w.engine.get_mix()[w.ids["lora_attn"]] == 1.0
    strip.solo.setChecked(True)  # only the vector sounds
    assert engine_vectors(w) == {vid: 0.6} and not any(w.engine.get_mix().values())
    strip.solo.setChecked(False)
    attn.solo.setChecked(True)  # only the adapter sounds
    assert engine_vectors(w) == {vid: 0.0} and w.engine.get_mix()[w.ids["lora_attn"]] == 1.0
    attn.solo.setChecked(False)
    strip.on.setChecked(False)  # mute
    assert engine_vectors(w) == {vid: 0.0}
    assert m.steps.undo_label() == "mute cv_a"
    m.undo()
    assert not strip.muted and engine_vectors(w) == {vid: 0.6}
    m.undo()  # unsolo, solo, unsolo, solo, then the fader
    for _ in range(4):
        m.undo()
    assert m.steps.redo_label() == "cv_a 0.00 → 0.60"
    assert strip.value == 0.0 and engine_vectors(w) == {vid: 0.0}


def test_presets_keep_vectors_and_old_presets_still_load(window, qtbot, vec_dir, tmp_path):
    from core.settings import Presets

    m = window.mixer
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf")
    vid = strip.info["vid"]
    strip.spin.setValue(0.7)
    strip.on.setChecked(False)
    m.save_preset("calm")
    saved = m.settings.presets.get("calm")
    assert saved["vectors"][str(vec_dir / "cv_a.gguf")]["scale"] == 0.7
    # written and read back (presets.json), the vectors are kept
    reread = Presets(m.settings.presets.path).get("calm")
    assert reread["vectors"] == saved["vectors"]
    strip.spin.setValue(0.0)
    strip.on.setChecked(True)
    assert m.modified.isVisible()
    assert m.load_preset("calm")
    assert (strip.value, strip.muted) == (0.7, True) and engine_vectors(window) == {vid: 0.0}
    assert not m.modified.isVisible()
    # a preset from before vectors: loads, the vector's strip goes to 0
    m.settings.presets.save("old", {"bypass": False, "adapters": {}})
    strip.on.setChecked(True)
    assert m.load_preset("old")
    assert strip.value == 0.0 and engine_vectors(window) == {vid: 0.0}
    # the desk across restarts keeps adapters only (a vector path is not an adapter)
    assert all("cv_a" not in e["path"] for e in m.desk_state()["adapters"])


def test_a_chat_reply_under_a_vector_strip_differs_from_at_zero(window, qtbot, vec_dir):
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf")

    def reply() -> str:
        gen = window.bridge.chat(MESSAGES, GREEDY)  # mix=None: the global mix, as the chat
        qtbot.waitUntil(lambda: gen.done is not None, timeout=20000)
        assert gen.done.stop_type != "error"
        return gen.text

    plain = reply()
    strip.spin.setValue(2.0)
    steered = reply()
    assert steered != plain


def test_ab_compare_with_a_vector_on_one_side(window, qtbot, vec_dir, greedy):
    m, cmp = window.mixer, window.compare
    greedy(window, n_predict=4)
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf")
    vid = strip.info["vid"]
    strip.spin.setValue(2.0)
    m.save_preset("steered")
    strip.spin.setValue(0.0)
    cmp.set_presets(BASE, "steered")
    assert cmp.mix_of(cmp.a).vectors == {vid: 0.0}
    assert cmp.mix_of(cmp.b).vectors == {vid: 2.0}
    assert "vec cv_a ×2.00" in cmp.b.mix_label.text()
    with qtbot.waitSignal(cmp.finished, timeout=30000):
        assert cmp.run("Tell me about the sea.")
    assert cmp.a.done.stop_type != "error" and cmp.b.done.stop_type != "error"
    assert cmp.a.text != cmp.b.text
    # the reply's key carries its vectors: the Diff scores each side as it ran
    assert key_mix(cmp.b.done.mix).vectors == {vid: 2.0}
    assert key_mix(cmp.a.done.mix).vectors == {}
    names = {k: s.info["name"] for k, s in m.strips.items()}
    assert mix_label(cmp.b.done.mix, names) == "vec cv_a ×2.00"
    cmp.diff_btn.setChecked(True)  # each reply scored under both sides' mixes
    qtbot.waitUntil(lambda: cmp.diff_worker is None, timeout=30000)
    assert cmp.a.other is not None and cmp.b.other is not None
    assert any(cmp.a.marks) or any(cmp.b.marks)  # the vector side's top-1 differs somewhere


def test_an_alora_strip_is_marked_and_shows_its_invocation(window, qtbot, ref_dir):
    window.adapters.add_paths([ref_dir / "adapters" / "lora_attn_alora.gguf"])
    qtbot.waitUntil(lambda: len(window.mixer.strips) == 1, timeout=10000)
    strip = next(iter(window.mixer.strips.values()))
    invocation = strip.info["alora_invocation_string"]
    assert strip.name.tag == "[aLoRA] " and strip.name.font().underline()
    strip.name.resize(400, strip.name.height())  # room: the tag shows before the name
    assert strip.name.text() == "[aLoRA] lora_attn_alora"
    strip.name.resize(60, strip.name.height())  # narrow: the name keeps the room
    assert strip.name.text().startswith("lora") and "[aLoRA]" not in strip.name.text()
    assert visible(invocation) in strip.name.toolTip()
    assert "\n" not in visible(invocation)
    assert visible("<|im_start|>assistant\n") == "“<|im_start|>assistant\\n”"


def test_a_vector_scale_is_a_grid_axis_and_use_this_mix_puts_it_on_the_desk(
    window, qtbot, vec_dir, greedy
):
    g = window.grid
    greedy(window, n_predict=4)
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf")
    vid = strip.info["vid"]
    g.x.set_axis("vector", "0, 2", vector=vid)
    g.y.set_axis(None, "")
    with qtbot.waitSignal(g.finished, timeout=30000):
        assert g.run("Tell me about the sea.")
    off, on = g.cards
    assert (off.cell.mix.vectors, on.cell.mix.vectors) == ({vid: 0.0}, {vid: 2.0})
    assert on.cell.x_label == "cv_a ×2"
    assert "vec cv_a ×2.00" in on.mix.text()
    assert off.text != on.text
    on.use.click()
    assert strip.value == 2.0 and engine_vectors(window) == {vid: 2.0}


# -- the rules without widgets ---------------------------------------------------------------
def test_desk_mix_splits_vectors_out_and_solo_crosses_kinds():
    from ui.desk import Channel, desk_mix, flat

    chans = {1: Channel(0.5), VecKey(1): Channel(0.8), VecKey(2): Channel(1.0, solo=True)}
    mix = desk_mix(chans)
    assert dict(mix) == {1: 0.0} and mix.vectors == {1: 0.0, 2: 1.0}
    assert flat(mix) == {1: 0.0, VecKey(1): 0.0, VecKey(2): 1.0}
    assert desk_mix({1: Channel(0.5)}).vectors is None  # no vector strips: not said
    assert desk_mix(chans, bypass=True).vectors == {1: 0.0, 2: 0.0}


def test_a_grid_cell_keeps_the_base_vectors_and_a_preset_brings_its_own():
    from core import grid as G
    from core.lora.mix import Mix

    base = Mix({1: 0.5}, vectors={7: 0.3})
    spec = G.GridSpec(
        G.Axis("preset", ("p",)),
        G.Axis("vector", (0.0, 1.5), vector=7, name="calm"),
        presets={"p": Mix({1: 1.0}, vectors={7: 0.9})},
    )
    cells = G.cells(spec, base)
    assert [c.mix.vectors for c in cells] == [{7: 0.0}, {7: 1.5}]
    assert cells[1].y_label == "calm ×1.5" and dict(cells[1].mix) == {1: 1.0}
    seed = G.GridSpec(G.Axis("seed", (1,)))
    assert G.cells(seed, base)[0].mix.vectors == {7: 0.3}
    with pytest.raises(G.GridError, match="vector scale"):
        G.check_axis(G.Axis("vector", (1000.0,), vector=7), "x", {})


def test_an_imported_preset_with_a_bad_vector_entry_is_refused(tmp_path):
    import json

    from core.errors import UserError
    from core.settings import read_presets_file

    good = {"p": {"adapters": {}, "vectors": {"/v/cv.gguf": {"name": "cv", "scale": 0.5}}}}
    (tmp_path / "ok.json").write_text(json.dumps(good))
    assert read_presets_file(tmp_path / "ok.json")["p"]["vectors"]["/v/cv.gguf"]["scale"] == 0.5
    bad = {"p": {"vectors": {"/v/cv.gguf": {"scale": 9}}}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="not in -2..2"):
        read_presets_file(tmp_path / "bad.json")


def test_a_chat_replys_caption_names_the_vectors_it_ran_under(window, qtbot, vec_dir, greedy):
    """The reply's caption ("mix: …") says what steered it, vectors included, as A/B's
    captions do; a reply without them says nothing of vectors."""
    greedy(window, n_predict=2)
    strip = add_vector(window, qtbot, vec_dir / "cv_a.gguf")
    strip.spin.setValue(1.5)
    assert window.chat.send("hi")
    qtbot.waitUntil(lambda: not window.chat.generating, timeout=30000)
    meta = window.chat.conversation["messages"][-1]["meta"]
    assert "vec cv_a ×1.50" in meta["mix"]
    assert "vec cv_a ×1.50" in window.chat.view.toPlainText()
    strip.spin.setValue(0.0)
    assert window.chat.send("again")
    qtbot.waitUntil(lambda: not window.chat.generating, timeout=30000)
    assert "vec" not in window.chat.conversation["messages"][-1]["meta"]["mix"]
