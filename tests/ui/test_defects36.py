"""Defects a new user met on the real window (issue #36), each reproduced first."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt


# -- 1. Preset Delete loses data --------------------------------------------------------------
def test_deleting_a_preset_offers_undo_and_ctrl_z_brings_it_back(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    m = w.mixer
    m.strips[aid].spin.setValue(0.7)
    m.save_preset("pirate")
    m.preset_box.setCurrentText("pirate")
    m.delete_action.trigger()
    assert w.settings.presets.names() == []
    assert json.loads(w.settings.presets.path.read_text()) == {}
    assert m.preset_undo.isVisible() and "pirate" in m.preset_undo.label.text()
    m.preset_undo.button.click()  # the Undo bar
    assert w.settings.presets.names() == ["pirate"]
    assert m.preset_box.currentText() == "pirate" and not m.preset_undo.isVisible()
    assert m.mix_for_preset("pirate")[aid] == pytest.approx(0.7)

    m.delete_action.trigger()
    assert w.settings.presets.names() == []
    w.activateWindow()
    m.setFocus()
    qtbot.keyClick(m, Qt.Key_Z, Qt.ControlModifier)  # Ctrl+Z, as for the mix
    assert w.settings.presets.names() == ["pirate"]
    assert "pirate" in json.loads(w.settings.presets.path.read_text())
    assert m.strips[aid].value == pytest.approx(0.7)  # the undo did not also move the mix


def test_rename_and_delete_are_disabled_with_no_preset_selected(loaded):
    m = loaded.mixer
    assert m.preset_box.currentText() == ""
    assert not m.rename_action.isEnabled() and not m.delete_action.isEnabled()
    m.save_preset("one")
    assert m.preset_box.currentText() == "one"
    assert m.rename_action.isEnabled() and m.delete_action.isEnabled()
    m.delete_action.trigger()
    assert not m.rename_action.isEnabled() and not m.delete_action.isEnabled()
