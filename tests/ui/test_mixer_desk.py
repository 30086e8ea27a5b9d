"""The mixer as a mixing desk (issue #17): reset gestures, fine drag, detents, Home,
a lit M, dimmed silent strips, undo/redo, the preset's modified mark, and a
confirmation before a preset is overwritten."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QMessageBox


def fader_x(slider, value: float) -> int:
    """The pixel of ``value`` on a fader (its groove spans the width minus the handle)."""
    from PySide6.QtWidgets import QStyle

    return (
        QStyle.sliderPositionFromValue(
            slider.minimum(), slider.maximum(), int(value * 100), slider.width() - 14
        )
        + 7
    )


def test_double_click_alt_click_and_home_reset_to_zero(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.spin.setValue(1.3)
    qtbot.mouseDClick(s.slider, Qt.LeftButton, pos=QPoint(10, s.slider.height() // 2))
    assert s.value == 0.0 and w.engine.get_mix()[aid] == 0.0
    s.spin.setValue(-0.7)
    qtbot.mouseClick(s.slider, Qt.LeftButton, Qt.AltModifier, QPoint(5, s.slider.height() // 2))
    assert s.value == 0.0
    s.spin.setValue(0.6)
    s.slider.setFocus()
    qtbot.keyClick(s.slider, Qt.Key_Home)
    assert s.value == 0.0  # not the −2 end


def test_a_drag_stops_at_the_detents_and_reaches_one(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    # the throw: 160 px made the desk scroll sideways at 1024 px; 100 still hits 1.00
    assert s.slider.minimumWidth() >= 100
    y = s.slider.height() // 2
    qtbot.mousePress(s.slider, Qt.LeftButton, pos=QPoint(s.slider.width() // 2, y))
    qtbot.mouseMove(s.slider, QPoint(fader_x(s.slider, 1.02), y))
    qtbot.mouseRelease(s.slider, Qt.LeftButton, pos=QPoint(fader_x(s.slider, 1.02), y))
    assert s.value == 1.0 and w.engine.get_mix()[aid] == 1.0


def test_shift_drag_is_fine(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.spin.setValue(0.5)
    y, x0 = s.slider.height() // 2, fader_x(s.slider, 0.5)
    qtbot.mousePress(s.slider, Qt.LeftButton, Qt.ShiftModifier, QPoint(x0, y))
    qtbot.mouseMove(s.slider, QPoint(x0 + 20, y))
    qtbot.mouseRelease(s.slider, Qt.LeftButton, Qt.ShiftModifier, QPoint(x0 + 20, y))
    normal = 20 * 400 / s.slider.width() / 100  # what a plain drag of 20 px moves
    assert 0.5 < s.value < 0.5 + normal / 2


def test_mute_lights_and_silent_strips_are_dimmed(loaded):
    w, ids = loaded, loaded.ids
    a, b = w.mixer.strips[ids["lora_attn"]], w.mixer.strips[ids["lora_ffn"]]
    assert a.on.text() == "M" and a.on.isChecked()  # unlit while on
    a.on.setChecked(False)
    assert a.muted and not a.name.isEnabled()  # lit M (qss :!checked), dimmed strip
    a.on.setChecked(True)
    b.solo.setChecked(True)
    assert not a.name.isEnabled() and b.name.isEnabled()  # left out by solo
    b.solo.setChecked(False)
    w.mixer.bypass.setChecked(True)
    assert not any(s.name.isEnabled() for s in w.mixer.strips.values())
    w.mixer.bypass.setChecked(False)
    assert all(s.name.isEnabled() for s in w.mixer.strips.values())


def test_undo_and_redo_the_mix(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    for v in (10, 20, 30, 40):  # one drag: one undo step
        s.slider.setValue(v)
    s.on.setChecked(False)
    assert w.engine.get_mix()[aid] == 0.0
    w.activateWindow()
    w.mixer.setFocus()
    qtbot.keyClick(w.mixer, Qt.Key_Z, Qt.ControlModifier)
    assert not s.muted and w.engine.get_mix()[aid] == pytest.approx(0.4)
    assert w.mixer.undo() and s.value == 0.0 and not w.mixer.undo()
    qtbot.keyClick(w.mixer, Qt.Key_Z, Qt.ControlModifier | Qt.ShiftModifier)
    assert s.value == pytest.approx(0.4)
    assert w.mixer.redo() and s.muted and w.engine.get_mix()[aid] == 0.0


def test_preset_modified_mark_and_overwrite_confirmation(loaded, monkeypatch):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.spin.setValue(0.5)
    w.mixer.save_preset("warm")
    assert not w.mixer.modified.isVisibleTo(w)
    s.spin.setValue(0.7)
    assert w.mixer.modified.isVisibleTo(w)  # the desk no longer matches "warm"
    s.spin.setValue(0.5)
    assert not w.mixer.modified.isVisibleTo(w)
    s.spin.setValue(0.9)
    asked = []
    monkeypatch.setattr("PySide6.QtWidgets.QInputDialog.getText", lambda *a, **k: ("warm", True))
    monkeypatch.setattr(
        QMessageBox, "question", lambda *a, **k: asked.append(a[2]) or QMessageBox.No
    )
    w.mixer._save_clicked()
    assert asked and "warm" in asked[0]
    assert w.settings.presets.get("warm")["adapters"][s.info["path"]]["scale"] == 0.5
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.Yes)
    w.mixer._save_clicked()
    assert w.settings.presets.get("warm")["adapters"][s.info["path"]]["scale"] == 0.9
    assert not w.mixer.modified.isVisibleTo(w)
