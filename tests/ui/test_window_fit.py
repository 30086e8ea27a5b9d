"""The window at a laptop's 1280x800 and a small 1024x700 (issue #17): the mixer shows
every column without a sideways scrollbar, whatever the chat's status line says, and
a reply's long code line wraps inside its block instead of widening the transcript."""

from __future__ import annotations

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QScrollArea

from core.lora.adapter import effective_scale

# what the chat's status line says while a reply streams (ChatPane._live)
STREAMING_STATUS = "First token after 0.32 s · 12.3 tok/s"


def _settle(qtbot):
    """Let the resized window's layouts run: each pass of posted LayoutRequests can
    post the next (window -> splitter -> chat column -> desk)."""
    from PySide6.QtCore import QCoreApplication

    for _ in range(4):
        QCoreApplication.sendPostedEvents()
        QCoreApplication.processEvents()


def _mixer_scroll(w) -> QScrollArea:
    return w.mixer.findChild(QScrollArea)


def _shown_in(widget, viewport) -> bool:
    """widget lies wholly inside the viewport (not clipped, not scrolled away)."""
    top_left = widget.mapTo(viewport, QPoint(0, 0))
    return viewport.rect().contains(QRect(top_left, widget.size()))


def test_every_mixer_column_fits_at_1280x800(loaded, qtbot):
    """Before: the chat's status line ("First token after … tok/s") widened the chat
    column, the splitter took the width from the desk, and the Effective column went
    under a horizontal scrollbar."""
    w = loaded
    w.resize(1280, 800)
    w.chat.status.setText(STREAMING_STATUS)
    for strip in w.mixer.strips.values():
        strip.set_value(-1.25)  # the widest scale and effective texts
    _settle(qtbot)
    scroll = _mixer_scroll(w)
    assert not scroll.horizontalScrollBar().isVisible()
    assert scroll.viewport().width() >= w.mixer.grid_host.minimumSizeHint().width()
    for strip in w.mixer.strips.values():
        for widget in strip.widgets():
            assert _shown_in(widget, scroll.viewport()), widget.objectName()
        a, r = strip.info.get("alpha"), strip.info.get("rank")
        assert strip.eff.text() == f"{effective_scale(-1.25, a, r):+.3f}"
        ratio = f"α{a:g}/r{r}" if a else f"rank {r}"
        assert ratio in strip.eff.toolTip()  # the ratio, one hover away
    # the status line itself is elided to its room, the full text in its tooltip
    assert w.chat.status.full_text == STREAMING_STATUS


def test_the_mixer_still_works_at_1024x700(loaded, qtbot):
    w = loaded
    w.resize(1024, 700)
    w.chat.status.setText(STREAMING_STATUS)
    _settle(qtbot)
    assert w.size().width() == 1024 and w.size().height() == 700
    scroll = _mixer_scroll(w)
    attn = w.mixer.strips[w.ids["lora_attn"]]
    for widget in (attn.on, attn.solo, attn.slider, attn.spin, attn.eff):
        # every column is reachable: scroll to it (the desk may scroll sideways here)
        centre = widget.mapTo(w.mixer.grid_host, widget.rect().center())
        scroll.ensureVisible(centre.x(), centre.y(), widget.width() // 2 + 1, 0)
        assert _shown_in(widget, scroll.viewport()), widget.objectName()
    attn.spin.setValue(0.5)
    assert w.engine.get_mix()[w.ids["lora_attn"]] == 0.5
    a, r = attn.info.get("alpha"), attn.info.get("rank")
    assert attn.eff.text() == f"{effective_scale(0.5, a, r):+.3f}"


def test_a_long_code_line_wraps_inside_its_block_at_1280x800(window, qtbot):
    w = window
    w.resize(1280, 800)
    line = "values = [" + ", ".join(f"'item{i:03d}'" for i in range(28)) + "]"
    token = "x" * 300  # and one with no place to break at all
    assert len(line) >= 300
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "a long line please"},
        {
            "role": "assistant",
            "content": f"Here:\n\n```python\n{line}\n```\n\nand\n\n```\n{token}\n```\n",
            "meta": {"tokens": 16, "tps": 3.0, "mix": "base", "stop": "eos"},
        },
    ]
    w.chat.render()
    _settle(qtbot)
    view = w.chat.view
    assert view.width() < 900  # far narrower than the 300-char lines
    assert view.horizontalScrollBar().maximum() == 0  # nothing to scroll sideways
    assert not view.horizontalScrollBar().isVisible()
    assert view.document().size().width() <= view.viewport().width()
    text = view.toPlainText()
    assert line in text and token in text  # wrapped on screen, not cut or split
    assert list(w.chat.codes.values()) == [line + "\n", token + "\n"]  # Copy per block
    assert text.count("Copy") >= 4  # two messages and two code blocks
