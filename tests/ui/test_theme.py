"""Light and dark themes from one colour table: the View menu forces Light / Dark or
follows the system's colour scheme, the choice persists, and the chat's colours follow."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette

from core.settings import Settings
from ui import theme as T


@pytest.fixture(autouse=True)
def _back_to_light(qapp):
    yield
    qapp.setPalette(T.palette(T.LIGHT))
    qapp.setStyleSheet("")


def _readable(pal: QPalette) -> None:
    """Body text at least WCAG AA (4.5:1) on the window and on text fields."""
    assert T.contrast(pal.color(QPalette.WindowText), pal.color(QPalette.Window)) >= 7
    assert T.contrast(pal.color(QPalette.Text), pal.color(QPalette.Base)) >= 7
    assert T.contrast(pal.color(QPalette.PlaceholderText), pal.color(QPalette.Base)) >= 4.5
    assert T.contrast(pal.color(QPalette.Link), pal.color(QPalette.Base)) >= 4.5


def test_forcing_dark_gives_a_dark_readable_window_and_chat(window, qtbot):
    w = window
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "code?"},
        {"role": "assistant", "content": "```python\nprint(1)\n```"},
    ]
    w.chat.render()
    assert w.theme_actions["system"].isChecked()  # the default
    w.theme_actions["dark"].trigger()
    qtbot.wait(20)
    pal = w.chat.view.palette()
    assert pal.color(QPalette.Window).lightness() < 60
    assert pal.color(QPalette.Base).lightness() < 60
    _readable(pal)
    assert w.palette().color(QPalette.Window).lightness() < 60
    # the transcript re-rendered in the dark colours: a dark code block
    html = w.chat.view.toHtml().lower()
    colors = T.DARK if w.theme.theme.dark else T.LIGHT
    assert colors is T.DARK
    code_bg = re.findall(r'bgcolor="(#[0-9a-f]{6})"', html)
    assert code_bg and all(int(c[1:3], 16) < 0x50 for c in code_bg)
    assert Settings().get("theme") == "dark"  # persisted

    w.theme_actions["light"].trigger()
    qtbot.wait(20)
    pal = w.chat.view.palette()
    assert pal.color(QPalette.Base).lightness() > 200
    _readable(pal)
    code_bg = re.findall(r'bgcolor="(#[0-9a-f]{6})"', w.chat.view.toHtml().lower())
    assert code_bg and all(int(c[1:3], 16) > 0xC0 for c in code_bg)


def test_the_choice_survives_a_restart(window, make_window):
    window.theme_actions["dark"].trigger()
    window.close()
    again = make_window()
    assert again.theme_actions["dark"].isChecked()
    assert again.palette().color(QPalette.Window).lightness() < 60


def test_system_follows_the_desktop_colour_scheme(window, qtbot):
    hints = QGuiApplication.styleHints()
    # what Qt sends when the desktop switches to dark (offscreen has no desktop to ask)
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
    qtbot.waitUntil(lambda: window.theme.theme is T.DARK, timeout=2000)
    assert window.palette().color(QPalette.Window).lightness() < 60
    window.theme_actions["light"].trigger()  # forced: the system no longer decides
    assert window.theme.theme is T.LIGHT
    window.theme_actions["system"].trigger()
    assert window.theme.theme is T.DARK
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert window.theme.theme is T.LIGHT
    assert window.palette().color(QPalette.Window).lightness() > 200


@pytest.mark.parametrize("theme", [T.LIGHT, T.DARK], ids=["light", "dark"])
def test_every_theme_fills_the_stylesheet_and_keeps_text_readable(theme):
    qss = T.stylesheet(theme)
    assert "$" not in qss
    assert T.contrast(theme.text, theme.window) >= 7 and T.contrast(theme.text, theme.surface) >= 7
    assert T.contrast(theme.muted, theme.surface) >= 4.5
    assert T.contrast(theme.on_accent, theme.accent) >= 3  # bold button text
    assert T.contrast(theme.error_text, theme.error_bg) >= 4.5
    assert T.contrast(theme.edit_text, theme.edit_bg) >= 4.5
    _readable(T.palette(theme))


def test_the_stylesheet_template_hard_codes_no_colour():
    assert not re.findall(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b", T.QSS.read_text())


def _centre(button) -> list[QColor]:
    """The pixels of the middle half of the button as drawn (its label and fill)."""
    img = button.grab().toImage()
    w, h = img.width(), img.height()
    return [
        QColor(img.pixel(x, y))
        for y in range(h // 4, h - h // 4)
        for x in range(w // 4, w - w // 4)
    ]


def _mean(pixels: list[QColor]) -> tuple[float, float, float]:
    n = len(pixels)
    return tuple(sum(getattr(p, c)() for p in pixels) / n for c in ("red", "green", "blue"))


def _label_contrast(pixels: list[QColor]) -> float:
    """Contrast of the label on the fill: the commonest colour is the fill, the pixel
    that differs most from it is the label's ink."""
    fill = QColor(Counter(p.rgb() for p in pixels).most_common(1)[0][0])
    return max(T.contrast(p, fill) for p in pixels)


@pytest.mark.parametrize("mode", ["dark", "light"])
def test_a_disabled_send_button_looks_disabled(window, qtbot, mode):
    """Before: in the dark theme a disabled Send (while a reply streams) kept its bright
    white label, the primary button's colour winning over QPushButton:disabled, so on
    its darker fill it read as enabled (more prominent, even, than when enabled)."""
    w = window
    w.theme_actions[mode].trigger()
    qtbot.wait(20)
    send = w.chat.send_btn
    send.setEnabled(True)
    on = _centre(send)
    send.setEnabled(False)  # as ChatPane._update_buttons does while generating
    off = _centre(send)
    send.setEnabled(True)
    (r0, g0, b0), (r1, g1, b1) = _mean(on), _mean(off)
    assert math.dist((r0, g0, b0), (r1, g1, b1)) >= 40  # a clearly different button
    assert _label_contrast(on) >= 3  # the enabled label reads well
    assert _label_contrast(off) <= 2.5  # the disabled one is muted
    # a tool button (the grid's Export…) had no :disabled rule at all
    export = w.grid.export_btn
    export.resize(export.sizeHint())
    export.setEnabled(True)
    on = _label_contrast(_centre(export))
    export.setEnabled(False)
    assert _label_contrast(_centre(export)) <= 2.5 < on
