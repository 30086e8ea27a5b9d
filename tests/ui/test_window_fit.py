"""The window at a laptop's 1280x800 and a small 1024x700 (issue #17): the mixer shows
every column without a sideways scrollbar at both, whatever the chat's status line
says, and a reply's long code line wraps inside its block instead of widening the
transcript."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QScrollArea

from core.lora.adapter import effective_scale
from ui.mixer import FADER_MIN_WIDTH

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


def _across(widget, viewport) -> bool:
    """widget lies inside the viewport's width (it may be scrolled down out of sight)."""
    left = widget.mapTo(viewport, QPoint(0, 0)).x()
    return left >= 0 and left + widget.width() <= viewport.width()


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
        assert _shown_in(widget, scroll.viewport()), widget.objectName()
    attn.spin.setValue(0.5)
    assert w.engine.get_mix()[w.ids["lora_attn"]] == 0.5
    a, r = attn.info.get("alpha"), attn.info.get("rank")
    assert attn.eff.text() == f"{effective_scale(0.5, a, r):+.3f}"


LONG_NAME = "a-rather-long-adapter-file-name-for-the-attention-layers"


@pytest.mark.parametrize(
    "size, extra",
    [((1024, 700), 0), ((1280, 800), 0), ((1024, 700), 5)],
    ids=["1024x700", "1280x800", "1024x700-8-adapters"],
)
def test_the_mixer_rows_fit_without_a_sideways_scrollbar(
    window, qtbot, ref_dir, tmp_path, size, extra
):
    """Before: at 1024x700 the rows (M, S, name, a fader of at least 160 px, the number,
    the effective scale) were ~75 px wider than the desk, which scrolled sideways.
    With 8 adapters the desk scrolls down, and its vertical bar takes 10 px more."""
    w = window
    src = ref_dir / "adapters"
    long = tmp_path / f"{LONG_NAME}.gguf"  # a long name must elide, not widen the row
    long.write_bytes((src / "lora_attn.gguf").read_bytes())
    paths = [src / "lora_all_q8.gguf", long, src / "lora_ffn.gguf"]
    for i in range(extra):
        paths.append(tmp_path / f"extra_{i}.gguf")
        paths[-1].write_bytes((src / "lora_attn.gguf").read_bytes())
    w.adapters.add_paths(paths)
    qtbot.waitUntil(lambda: len(w.mixer.strips) == len(paths), timeout=10000)
    w.resize(*size)
    w.chat.status.setText(STREAMING_STATUS)
    for strip in w.mixer.strips.values():
        strip.set_value(-1.25)  # the widest scale and effective texts
    _settle(qtbot)
    assert (w.width(), w.height()) == size
    scroll = _mixer_scroll(w)
    bar = scroll.horizontalScrollBar()
    assert not bar.isVisible() and bar.maximum() == 0
    assert scroll.verticalScrollBar().isVisible() == bool(extra)
    viewport = scroll.viewport()
    shown = _across if extra else _shown_in  # 8 rows: the last ones are below the fold
    for header in w.mixer.headers:
        assert shown(header, viewport), header.text()
    for strip in w.mixer.strips.values():
        for widget in strip.widgets():
            assert shown(widget, viewport), widget.objectName()
            if widget is not strip.name:  # the name elides; nothing else is squeezed
                least = widget.minimumWidth() or widget.minimumSizeHint().width()
                assert widget.width() >= least, widget.objectName()
        assert strip.slider.width() >= FADER_MIN_WIDTH
        name = strip.name  # elided inside its padding, never clipped ("pirat")
        assert name.fontMetrics().horizontalAdvance(name.text()) <= name.contentsRect().width()
        if size == (1280, 800) and strip.info["name"] != LONG_NAME:
            assert name.text() == strip.info["name"]  # short names whole where there is room
    named = [s for s in w.mixer.strips.values() if s.info["name"] == LONG_NAME]
    assert len(named) == 1
    label = named[0].name
    assert label.text() != LONG_NAME and label.text().endswith("…")  # elided on the desk
    assert LONG_NAME in label.toolTip()  # the full name, one hover away


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


def test_the_adapter_list_fits_at_1024x700_with_targets_elided(loaded, qtbot):
    """Before: every column sized to its contents, so at 1024x700 the list under the
    mixer scrolled sideways to show the Targets column. Now Targets takes the room
    that is left, elided, with the full list in its tooltip; the other columns stay
    whole."""
    from ui.adapters import COLUMNS, TARGETS_COL

    w = loaded
    w.resize(1024, 700)
    _settle(qtbot)
    tree = w.adapters.tree
    assert not tree.horizontalScrollBar().isVisible()
    assert tree.horizontalScrollBar().maximum() == 0
    hdr = tree.header()
    for col in range(len(COLUMNS)):
        if col != TARGETS_COL:  # whole: at least its contents' width
            assert hdr.sectionSize(col) >= tree.sizeHintForColumn(col), COLUMNS[col]
    targets = {a["name"]: a["targets"] for a in w.engine.adapters()}
    assert tree.topLevelItemCount() == len(targets) == 3
    for i in range(tree.topLevelItemCount()):
        item = tree.topLevelItem(i)
        assert item.toolTip(TARGETS_COL) == ", ".join(targets[item.text(0)])  # one hover away
