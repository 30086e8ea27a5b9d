"""The mixing desk drives the engine mix, and mixes set elsewhere move the desk."""

from __future__ import annotations

import threading

import pytest


def test_slider_and_spin_set_engine_mix_immediately(loaded):
    w, ids = loaded, loaded.ids
    attn, ffn, allq = ids["lora_attn"], ids["lora_ffn"], ids["lora_all_q8"]
    w.mixer.strips[attn].slider.setValue(75)  # slider: 0.75, no reload, no wait
    assert w.engine.get_mix()[attn] == pytest.approx(0.75)
    w.mixer.strips[ffn].spin.setValue(-1.234)  # precise box
    assert w.engine.get_mix()[ffn] == pytest.approx(-1.234)
    assert w.mixer.strips[ffn].slider.value() == -123
    info = {a["id"]: a for a in w.engine.adapters()}  # what GET /lora-adapters serves
    assert info[attn]["scale"] == pytest.approx(0.75)
    # effective scale shown with alpha/rank: lora_attn has alpha 16, rank 8
    assert w.mixer.strips[attn].eff.text().startswith("+1.500")

    w.mixer.strips[attn].on.setChecked(False)  # mute
    assert w.engine.get_mix()[attn] == 0.0
    w.mixer.strips[attn].on.setChecked(True)
    assert w.engine.get_mix()[attn] == pytest.approx(0.75)

    w.mixer.strips[allq].spin.setValue(0.5)
    w.mixer.strips[allq].solo.setChecked(True)  # solo: only soloed strips sound
    assert w.engine.get_mix() == {allq: 0.5, attn: 0.0, ffn: 0.0}
    w.mixer.strips[allq].solo.setChecked(False)

    w.mixer.bypass.setChecked(True)  # master bypass
    assert set(w.engine.get_mix().values()) == {0.0}
    w.mixer.bypass.setChecked(False)
    assert w.engine.get_mix()[ffn] == pytest.approx(-1.234)


def test_mix_set_from_another_thread_moves_sliders(loaded, qtbot):
    """A mix set on another thread (the HTTP API's) reaches the sliders through a
    queued signal, on the GUI thread. How fast is a property of the machine, not
    of the code, so only the arrival is asserted here."""
    w, ids = loaded, loaded.ids
    attn = ids["lora_attn"]
    w.mixer.strips[attn].on.setChecked(False)  # muted, then the API sets it
    gui_thread = threading.get_ident()
    seen_on = []
    # the desk moves its faders with signals blocked, so watch the signal that moves them
    w.bridge.mix_changed.connect(lambda *_: seen_on.append(threading.get_ident()))
    t = threading.Thread(target=w.engine.set_mix, args=({attn: 1.5},), kwargs={"source": "api"})
    t.start()
    qtbot.waitUntil(lambda: w.mixer.strips[attn].spin.value() == pytest.approx(1.5), timeout=5000)
    t.join()
    assert seen_on and set(seen_on) == {gui_thread}
    assert not w.mixer.strips[attn].muted  # the desk now implies that mix
    assert w.mixer.desk_mix() == w.engine.get_mix()


def test_presets_save_load_rename_delete(loaded, make_window):
    w, ids = loaded, loaded.ids
    attn, ffn = ids["lora_attn"], ids["lora_ffn"]
    w.mixer.strips[attn].spin.setValue(0.6)
    w.mixer.strips[ffn].spin.setValue(-0.4)
    w.mixer.strips[ffn].on.setChecked(False)
    w.mixer.save_preset("warm")
    w.mixer.zero_all()
    w.mixer.strips[ffn].on.setChecked(True)
    assert set(w.engine.get_mix().values()) == {0.0}

    assert w.mixer.load_preset("warm")
    assert w.mixer.strips[attn].value == pytest.approx(0.6)
    assert w.mixer.strips[ffn].value == pytest.approx(-0.4) and w.mixer.strips[ffn].muted
    assert w.engine.get_mix()[attn] == pytest.approx(0.6) and w.engine.get_mix()[ffn] == 0.0

    w.mixer.rename_preset("warm", "cosy")
    assert w.settings.presets.names() == ["cosy"]
    assert w.mixer.mix_for_preset("cosy")[attn] == pytest.approx(0.6)
    w.mixer.save_preset("other")
    w.mixer.delete_preset("other")
    assert w.settings.presets.names() == ["cosy"]
    assert [w.mixer.preset_box.itemText(i) for i in range(w.mixer.preset_box.count())] == ["cosy"]


def test_renaming_a_preset_onto_another_name_is_refused_with_a_message(loaded, qtbot, monkeypatch):
    """The refusal is a UserError the mixer shows; it is no longer a ValueError, so
    the mixer must catch it by its real type (issue #16) instead of crashing."""
    from PySide6.QtWidgets import QInputDialog

    w = loaded
    w.mixer.save_preset("one")
    w.mixer.save_preset("two")
    w.mixer.preset_box.setCurrentText("one")
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("two", True))
    with qtbot.waitSignal(w.mixer.message, timeout=5000) as said:
        w.mixer._rename_clicked()
    assert "already exists" in said.args[0]
    assert w.settings.presets.names() == ["one", "two"]


def test_bad_adapter_shows_inline_error_and_the_rest_keep_working(loaded, qtbot, tmp_path):
    w, ids = loaded, loaded.ids
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    notgguf = tmp_path / "notes.gguf"
    notgguf.write_text("this is not a model")
    w.adapters.add_paths([bad, notgguf])
    qtbot.waitUntil(lambda: len(w.adapters.errors) == 2, timeout=5000)
    assert all(m for m in w.adapters.errors.values())
    assert w.banner.isVisible() and "Adapter not loaded" in w.banner.label.text()
    assert len(w.engine.adapters()) == 3 and len(w.mixer.strips) == 3
    w.mixer.strips[ids["lora_attn"]].spin.setValue(0.9)  # the desk keeps working
    assert w.engine.get_mix()[ids["lora_attn"]] == pytest.approx(0.9)
    red = [
        w.adapters.tree.topLevelItem(i).text(5) for i in range(w.adapters.tree.topLevelItemCount())
    ]
    assert sum(t.startswith("✗") for t in red) == 2


def test_remove_adapter_removes_its_strip(loaded, qtbot):
    w, ids = loaded, loaded.ids
    w.bridge.remove_adapter(ids["lora_ffn"])
    qtbot.waitUntil(lambda: len(w.mixer.strips) == 2, timeout=2000)
    assert ids["lora_ffn"] not in w.mixer.strips


def test_merge_method_selector_drives_the_engine_and_presets_keep_it(loaded, qtbot):
    """#21: the desk's method combo sets the engine mix's method, density/rank/seed show
    only where the method uses them, and presets, undo, A/B compare's preset mix and a
    method set through the API all follow."""
    from core.lora.merge import MergeSpec
    from core.lora.mix import Mix

    w, ids = loaded, loaded.ids
    m = w.mixer
    attn, allq = ids["lora_attn"], ids["lora_all_q8"]
    m.strips[attn].spin.setValue(0.8)
    m.strips[allq].spin.setValue(0.6)

    def shown():
        return {n for n, wid in m._merge_widgets.items() if wid.isVisibleTo(m)}

    assert m.method.currentText() == "linear" and shown() == set()
    assert w.engine.get_mix().merge == MergeSpec.make("linear")
    m.method.setCurrentText("ties")
    assert shown() == {"density", "rank"}
    assert w.engine.get_mix().merge == MergeSpec.make("ties")
    m.density.setValue(0.3)
    m.rank.setValue(16)
    assert w.engine.get_mix().merge == MergeSpec.make("ties", density=0.3, rank=16)
    m.method.setCurrentText("dare_linear")
    m.seed.setValue(5)
    dare = MergeSpec.make("dare_linear", density=0.3, rank=16, seed=5)
    assert shown() == {"density", "rank", "seed"} and w.engine.get_mix().merge == dare
    assert w.engine.get_mix()[attn] == pytest.approx(0.8)  # the faders are untouched

    m.save_preset("dare")
    m.method.setCurrentText("svd")
    assert shown() == {"rank"} and not m.matches_preset("dare")
    assert m.load_preset("dare")
    assert m.method.currentText() == "dare_linear" and w.engine.get_mix().merge == dare
    assert m.mix_for_preset("dare").merge == dare  # what A/B compare submits for that side

    m.method.setCurrentText("linear")
    assert m.undo() and m.method.currentText() == "dare_linear"
    assert w.engine.get_mix().merge == dare

    prune = MergeSpec.make("magnitude_prune", density=0.7)
    w.engine.set_mix(Mix(w.engine.get_mix(), prune), source="api")
    qtbot.waitUntil(lambda: m.method.currentText() == "magnitude_prune", timeout=5000)
    assert m.density.value() == pytest.approx(0.7) and m.merge_spec() == prune
