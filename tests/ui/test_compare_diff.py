"""The A/B diff view (#21): after a compare, Diff marks exactly the tokens where core
says the two mixes' top-1 differ, hovering a token shows both mixes' top-5, and two
identical mixes mark nothing. Real SmolLM2 and reference adapters, real widgets."""

from __future__ import annotations

import html

import pytest
from PySide6.QtCore import QEvent, QPoint
from PySide6.QtGui import QColor, QHelpEvent, QTextCursor
from PySide6.QtWidgets import QApplication, QToolTip

from core.serve.score import disagreements
from ui import theme as T
from ui.compare import BASE, DIFF_TOP_K

PROMPT = "Tell me about the moon."
WAIT_MS = 300000  # the machine may be busy: a hung run fails instead of blocking


def run_compare(w, qtbot, a: str, b: str) -> None:
    tabs = w.tabs
    tabs.setCurrentIndex(next(i for i in range(tabs.count()) if tabs.tabText(i) == "A/B compare"))
    w.compare.set_presets(a, b)
    with qtbot.waitSignal(w.compare.finished, timeout=WAIT_MS):
        assert w.compare.run(PROMPT)
    assert w.compare.diff_btn.isEnabled()


def show_diff(w, qtbot) -> None:
    w.compare.diff_btn.click()  # a user's click: toggles it on, scoring starts
    assert w.compare.diff_btn.isChecked()
    qtbot.waitUntil(lambda: w.compare.diff_worker is None, timeout=WAIT_MS)
    assert w.compare.a.own is not None, w.compare.diff_hint.text()


def core_marks(engine, side, other_mix) -> list[bool]:
    """What core says, computed here on its own: the side's reply scored under its
    own mix and under the other side's, one call each."""
    prompt = engine.chat_prompt([{"role": "user", "content": PROMPT}])
    tokens = prompt + side.done.tokens
    return disagreements(
        engine.score(tokens, dict(side.done.mix), len(prompt)),
        engine.score(tokens, dict(other_mix), len(prompt)),
    )


def highlighted(view) -> list[bool]:
    """Per token of the view: drawn on the diff background?"""
    want = QColor(T.current().diff_bg)
    out = []
    for a, b in view.spans:
        cur = QTextCursor(view.document())
        cur.setPosition(a + 1)  # the format of the character at a
        out.append(cur.charFormat().background().color() == want and b > a)
    return out


def visible_char(view, i: int) -> int:
    """A document position of token i's first visible character, or -1 (a space at a
    line wrap has no glyph to point at)."""
    a, b = view.spans[i]
    text = view.toPlainText()
    return next((k for k in range(a, b) if not text[k].isspace()), -1)


def hover(view, qtbot, i: int) -> str:
    """Hover token i as the mouse would (a ToolTip help event on the viewport) and
    return the tooltip shown."""
    k = visible_char(view, i)
    cur = QTextCursor(view.document())
    cur.setPosition(k + 1)
    view.setTextCursor(cur)
    view.ensureCursorVisible()  # scrolled into view, as a user would
    cur.setPosition(k)
    left = view.cursorRect(cur)
    cur.setPosition(k + 1)
    right = view.cursorRect(cur)
    assert right.top() == left.top()
    pos = QPoint((left.left() + right.left()) // 2, left.center().y())  # mid-glyph
    assert view.token_at(pos) == i
    QToolTip.hideText()
    ev = QHelpEvent(QEvent.ToolTip, pos, view.viewport().mapToGlobal(pos))
    QApplication.sendEvent(view.viewport(), ev)
    qtbot.waitUntil(QToolTip.isVisible, timeout=5000)
    return QToolTip.text()


@pytest.fixture
def two_mixes(loaded, greedy):
    """Preset "mixed" (attn 1, ffn 0.5) on A, the base model on B: the reference
    adapters change the greedy reply at this prompt within 12 tokens."""
    w, ids = loaded, loaded.ids
    greedy(w, n_predict=12)
    w.mixer.strips[ids["lora_attn"]].spin.setValue(1.0)
    w.mixer.strips[ids["lora_ffn"]].spin.setValue(0.5)
    w.mixer.save_preset("mixed")
    w.mixer.zero_all()
    return w


def test_diff_marks_where_core_says_the_two_mixes_disagree(two_mixes, qtbot):
    w = two_mixes
    run_compare(w, qtbot, "mixed", BASE)
    a, b = w.compare.a, w.compare.b
    assert a.done.tokens != b.done.tokens, "the two mixes reply differently here"
    show_diff(w, qtbot)

    for side, other in ((a, b), (b, a)):
        want = core_marks(w.engine, side, other.done.mix)
        assert side.marks == want
        assert highlighted(side.view) == want
        assert len(side.view.spans) == len(side.done.tokens)
    assert any(a.marks) and any(b.marks)
    hint = w.compare.diff_hint.text()
    assert f"{sum(a.marks)} of {len(a.marks)}" in hint
    assert f"{sum(b.marks)} of {len(b.marks)}" in hint

    # hovering a marked token of B's reply shows B's and A's top-5 at that position
    i = next(i for i, m in enumerate(b.marks) if m and visible_char(b.view, i) >= 0)
    tip = hover(b.view, qtbot, i)
    for scored in (b.own[i], b.other[i]):
        assert len(scored.top) == DIFF_TOP_K
        for c in scored.top:
            assert html.escape(repr(c.text)[1:-1] or "∅") in tip
            assert f"{c.logprob:.2f}" in tip
    assert "top-1 differs" in tip and "mixed" in tip and "base model" in tip

    # Diff off: the plain reply again; on: the marks come back without re-scoring
    w.compare.diff_btn.click()
    assert w.compare.diff_hint.text() == ""
    assert a.view.toPlainText().strip() == a.done.content.strip()
    assert b.view.spans == []  # no token tooltips over the plain reply
    w.compare.diff_btn.click()
    assert w.compare.diff_worker is None and highlighted(a.view) == a.marks


def test_identical_mixes_mark_nothing(two_mixes, qtbot):
    w = two_mixes
    run_compare(w, qtbot, "mixed", "mixed")
    show_diff(w, qtbot)
    for side in (w.compare.a, w.compare.b):
        assert side.marks == [False] * len(side.done.tokens)
        assert not any(highlighted(side.view))
    assert "differ at 0 of" in w.compare.diff_hint.text()
    assert " and 0 of" in w.compare.diff_hint.text()


@pytest.mark.parametrize("scheme", [T.LIGHT, T.DARK])
def test_the_diff_mark_reads_in_both_themes(scheme):
    assert T.contrast(scheme.text, scheme.diff_bg) >= 4.5
    assert T.contrast(scheme.surface, scheme.diff_bg) >= 1.5  # visible against the page


def test_a_diff_that_cannot_run_says_why_and_the_pane_goes_on(two_mixes, qtbot, greedy):
    """An adapter of side A is unloaded (say over HTTP) between the run and Diff: the
    hint says why, Diff is off again, and Run and Diff stay usable."""
    w = two_mixes
    greedy(w, n_predict=3)
    run_compare(w, qtbot, "mixed", BASE)
    w.engine.remove_adapter(w.ids["lora_attn"])
    w.compare.diff_btn.click()
    qtbot.waitUntil(lambda: w.compare.diff_worker is None, timeout=WAIT_MS)
    assert w.compare.diff_hint.text() == f"Diff failed: no adapter with id {w.ids['lora_attn']}"
    assert not w.compare.diff_btn.isChecked() and w.compare.a.own is None
    assert w.compare.run_btn.isEnabled() and w.compare.diff_btn.isEnabled()
    assert w.compare.a.view.toPlainText().strip() == w.compare.a.done.content.strip()
