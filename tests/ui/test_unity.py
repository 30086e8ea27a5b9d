"""Unity mode (issue 36): the faders and number boxes in effective units, scale × α / r,
so that 1.0 is the adapter as trained; the mix itself stays in llama-server's scale."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from test_mixer_desk import fader_x


def trained(window) -> tuple[int, float]:
    """An adapter whose α / r is not 1 (so the two units differ), and that ratio."""
    for aid, s in window.mixer.strips.items():
        a, r = s.info.get("alpha"), s.info.get("rank")
        if a and a / r != 1.0:
            return aid, a / r
    pytest.fail("no reference adapter has α / r ≠ 1")


def test_unity_mode_shows_effective_units_and_keeps_the_mix_in_scale(loaded, make_window):
    w = loaded
    aid, ratio = trained(w)
    s, m = w.mixer.strips[aid], w.mixer
    s.spin.setValue(0.5)
    assert w.engine.get_mix()[aid] == pytest.approx(0.5)
    assert not w.unity_action.isChecked()

    w.unity_action.trigger()  # View → Unity faders
    assert w.settings.get("unity") is True
    # the display changed, the mix did not
    assert w.engine.get_mix()[aid] == pytest.approx(0.5)
    assert s.spin.value() == pytest.approx(0.5 * ratio, abs=1e-3)
    assert s.slider.value() == round(0.5 * ratio * 100)
    assert s.eff.text() == f"{0.5 * ratio:+.3f}"  # the Effective column agrees
    assert "trained" in m.headers[3].toolTip()

    s.spin.setValue(1.0)  # the user types "as trained"
    assert w.engine.get_mix()[aid] == pytest.approx(1.0 / ratio)
    assert s.eff.text() == "+1.000"
    # presets and undo keep llama-server's scale
    assert m.preset_state()["adapters"][s.info["path"]]["scale"] == pytest.approx(1.0 / ratio)
    m.undo()  # (the step may join the 0.5 before it: one gesture on one strip)
    undone = w.engine.get_mix()[aid]
    assert undone != pytest.approx(1.0 / ratio)
    assert s.spin.value() == pytest.approx(undone * ratio, abs=1e-3)

    # a mix set from outside (HTTP) shows in effective units too
    w.engine.set_mix({**w.engine.get_mix(), aid: 0.25}, source="api")
    w.mixer._reconcile(w.engine.get_mix())
    assert s.spin.value() == pytest.approx(0.25 * ratio, abs=1e-3)

    w.unity_action.trigger()  # back to scale units: the mix is untouched
    assert w.engine.get_mix()[aid] == pytest.approx(0.25)
    assert s.spin.value() == pytest.approx(0.25)
    assert s.slider.value() == 25


def test_unity_mode_is_remembered(loaded, make_window):
    loaded.unity_action.trigger()
    again = make_window()
    assert again.unity_action.isChecked() and again.mixer.unity


def test_unity_detents_are_in_displayed_units(loaded, qtbot):
    w = loaded
    aid, ratio = trained(w)
    w.unity_action.trigger()
    s = w.mixer.strips[aid]
    y = s.slider.height() // 2
    x = fader_x(s.slider, 1.0 + 0.02 * ratio)  # a drag that ends just past effective 1.0
    qtbot.mousePress(s.slider, Qt.LeftButton, pos=QPoint(fader_x(s.slider, 0.3), y))
    qtbot.mouseMove(s.slider, QPoint(x, y))
    qtbot.mouseRelease(s.slider, Qt.LeftButton, pos=QPoint(x, y))
    assert s.spin.value() == 1.0
    assert w.engine.get_mix()[aid] == pytest.approx(1.0 / ratio)
