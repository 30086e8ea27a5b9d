"""The keys every pane shares (ui.util.run_controls): Ctrl+Enter runs from either Enter
key, Esc stops. Compare and the grid once took only the main Enter key, so Ctrl+keypad
Enter did nothing there while it sent in the chat."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

ENTER_KEYS = [
    pytest.param(Qt.Key_Return, Qt.ControlModifier, id="return"),
    pytest.param(Qt.Key_Enter, Qt.ControlModifier | Qt.KeypadModifier, id="keypad-enter"),
]


def _pane(w, name):
    """(pane, its prompt field, the signal it emits when a run ends)."""
    if name == "chat":
        return w.chat, w.chat.input, w.chat.reply_finished
    pane = getattr(w, name)
    return pane, pane.prompt, pane.finished


def _show(w, name, pane):
    w.tabs.setCurrentIndex(0 if name == "chat" else w.tabs.indexOf(pane.parentWidget()))


@pytest.mark.parametrize("key,mods", ENTER_KEYS)
@pytest.mark.parametrize("name", ["chat", "compare", "grid"])
def test_ctrl_enter_runs_each_pane(loaded, qtbot, greedy, name, key, mods):
    w = loaded
    greedy(w, n_predict=2)
    if name == "grid":
        w.grid.x.set_axis("seed", "1, 2")
    pane, field, done = _pane(w, name)
    _show(w, name, pane)
    field.setFocus()
    qtbot.keyClicks(field, "Name a colour.")
    with qtbot.waitSignal(done, timeout=120000):
        qtbot.keyClick(field, key, mods)
    assert not pane.stop_btn.isEnabled()  # it ran and finished


@pytest.mark.parametrize("name", ["chat", "compare", "grid"])
def test_escape_stops_each_pane(loaded, qtbot, greedy, name):
    w = loaded
    greedy(w, n_predict=400)
    if name == "grid":
        w.grid.x.set_axis("seed", "1, 2")
    pane, field, done = _pane(w, name)
    _show(w, name, pane)
    field.setFocus()
    qtbot.keyClicks(field, "Write a long story about the sea.")
    with qtbot.waitSignal(done, timeout=120000) as got:
        qtbot.keyClick(field, Qt.Key_Return, Qt.ControlModifier)
        assert pane.stop_btn.isEnabled()
        qtbot.keyClick(field, Qt.Key_Escape)
    if name == "chat":
        stops = [got.args[0]["meta"]["stop"]]
    elif name == "compare":
        qtbot.waitUntil(lambda: pane.a.done is not None and pane.b.done is not None)
        stops = [pane.a.done.stop_type, pane.b.done.stop_type]
    else:
        stops = [c.done.stop_type for c in pane.cards]
    assert stops and set(stops) == {"cancel"}
