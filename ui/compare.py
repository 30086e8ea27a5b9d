"""A/B compare: one prompt under two mixes (preset A, preset B), both submitted at
once so the engine batches them, replies streaming side by side.

The Diff toggle (#21) shows where the two mixes disagree: each reply is scored under
both mixes (core.serve.score, on the engine thread, from a worker), and every token
where the two mixes' top-1 differ is highlighted; hovering a token shows both mixes'
top-5 at that position."""

from __future__ import annotations

import html

from PySide6.QtCore import QEvent, QPoint, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTextBrowser,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from core.lora.mix import Mix, mix_text
from core.serve.score import TokenScore, disagreements

from . import theme
from .bridge import EngineBridge, Generation
from .chat import palette_colors
from .desk import VecKey, key_mix, mix_label
from .markdown import render as render_md
from .mixer import MixerPanel
from .sampling import SamplingForm
from .util import prompt_row

CURRENT = "(current desk mix)"
BASE = "(base model, no adapters)"
DIFF_TOP_K = 5  # candidates per mix in a token's tooltip
END_MARK = "⏎end"  # an end-of-generation token, drawn so that it can be marked and hovered


class ReplyView(QTextBrowser):
    """One side's reply. In the diff view it is drawn token by token: ``spans`` are the
    document ranges of the tokens and ``tips`` their tooltips (shown on hover)."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[int, int]] = []
        self.tips: list[str] = []

    def show_tokens(self, texts: list[str], marked: list[bool], tips: list[str]) -> None:
        """Draw the tokens as plain text (never interpreted as HTML or Markdown), the
        marked ones on the theme's diff background."""
        self.clear()
        cur = QTextCursor(self.document())
        plain, mark = QTextCharFormat(), QTextCharFormat()
        mark.setBackground(QColor(theme.current().diff_bg))
        self.spans, self.tips = [], list(tips)
        for text, hit in zip(texts, marked):
            p0 = cur.position()
            cur.insertText(text, mark if hit else plain)
            self.spans.append((p0, cur.position()))

    def token_at(self, pos: QPoint) -> int:
        """The index of the token under a viewport point, or -1."""
        doc_pos = pos + QPoint(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        at = self.document().documentLayout().hitTest(doc_pos, Qt.ExactHit)
        return next((i for i, (a, b) in enumerate(self.spans) if a <= at < b), -1)

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.ToolTip and self.spans:
            i = self.token_at(event.pos())
            if i >= 0:
                QToolTip.showText(event.globalPos(), self.tips[i], self.viewport())
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(event)


class Side:
    def __init__(self, label: str):
        self.combo = QComboBox()
        self.combo.setMinimumWidth(160)
        self.title = QLabel(label)
        self.title.setObjectName("sectionTitle")
        self.mix_label = QLabel()
        self.mix_label.setObjectName("hint")
        self.mix_label.setWordWrap(True)
        self.view = ReplyView()
        self.meta = QLabel()
        self.meta.setObjectName("hint")
        self.gen: Generation | None = None
        self.text = ""
        self.done = None
        self.preset = ""  # the preset the last run used
        # the diff view: this reply scored under its own mix and under the other side's
        self.own: list[TokenScore] | None = None
        self.other: list[TokenScore] | None = None
        self.marks: list[bool] = []


class ComparePane(QWidget):
    finished = Signal()  # both sides done

    def __init__(
        self,
        bridge: EngineBridge,
        mixer: MixerPanel,
        sampling: SamplingForm,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self.bridge = bridge
        self.mixer = mixer
        self.sampling = sampling
        self.a, self.b = Side("A"), Side("B")

        self.diff_btn = QPushButton("Diff")
        self.diff_btn.setCheckable(True)
        self.diff_btn.setEnabled(False)
        self.diff_btn.setToolTip(
            "Mark each token where the two mixes' top-1 differ (each reply is scored under "
            "both mixes); hover a token for both mixes' top-5"
        )
        self.diff_btn.toggled.connect(self._diff_toggled)
        self.prompt, self.run_btn, self.stop_btn, row = prompt_row(
            self, "One prompt, two mixes", "Run A/B", self.run, self.stop, self.diff_btn
        )
        self.diff_hint = QLabel()
        self.diff_hint.setObjectName("hint")
        self.diff_hint.setWordWrap(True)
        self.diff_worker = None
        self._messages: list[dict] = []

        grid = QGridLayout()
        for col, side in enumerate((self.a, self.b)):
            head = QHBoxLayout()
            head.addWidget(side.title)
            head.addWidget(QLabel("Preset"))
            head.addWidget(side.combo, 1)
            grid.addLayout(head, 0, col)
            grid.addWidget(side.mix_label, 1, col)
            grid.addWidget(side.view, 2, col)
            grid.addWidget(side.meta, 3, col)
            side.combo.currentTextChanged.connect(self._combo_changed)
        grid.setRowStretch(2, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(grid, 1)
        lay.addWidget(self.diff_hint)
        lay.addLayout(row)

        self._timer = QTimer(self, singleShot=True, interval=60)
        self._timer.timeout.connect(self._render)
        mixer.presets_changed.connect(self.refresh_presets)
        bridge.adapters_changed.connect(lambda _: self._preview())
        # "(current desk mix)" is the live desk: its caption follows every change, the
        # desk's own and one set from outside (the API, the grid's "Use this mix")
        mixer.mix_applied.connect(lambda _: self._preview())
        bridge.mix_changed.connect(lambda _: self._preview())
        bridge.vectors_changed.connect(lambda _: self._preview())
        self.refresh_presets()

    def refresh_presets(self) -> None:
        names = [CURRENT, BASE] + self.mixer.settings.presets.names()
        saved = self.mixer.settings.get("compare") or {}
        for side, key in ((self.a, "a"), (self.b, "b")):
            cur = side.combo.currentText() or saved.get(key, "")
            side.combo.blockSignals(True)
            side.combo.clear()
            side.combo.addItems(names)
            i = side.combo.findText(cur)
            side.combo.setCurrentIndex(
                max(i, 0) if key == "a" or i >= 0 else min(1, len(names) - 1)
            )
            side.combo.blockSignals(False)
        self._preview()

    def set_presets(self, a: str, b: str) -> None:
        self.a.combo.setCurrentText(a)
        self.b.combo.setCurrentText(b)

    def mix_of(self, side: Side) -> dict[int, float] | None:
        name = side.combo.currentText()
        if name == BASE:  # every adapter and every vector at 0
            keys = self.mixer.strips
            vectors = {k.id: 0.0 for k in keys if isinstance(k, VecKey)}
            return Mix({a: 0.0 for a in keys if not isinstance(a, VecKey)}, vectors=vectors)
        return self.mixer.mix_for_preset("" if name in (CURRENT, "") else name)

    def _preview(self, *_) -> None:
        names = {a: s.info["name"] for a, s in self.mixer.strips.items()}
        for side in (self.a, self.b):
            mix = self.mix_of(side)
            side.mix_label.setText("mix: " + (mix_label(mix, names) if mix is not None else "?"))

    def _combo_changed(self, *_) -> None:
        self._preview()
        if self.a.combo.currentText():
            self.mixer.settings.set(
                "compare", {"a": self.a.combo.currentText(), "b": self.b.combo.currentText()}
            )

    @property
    def running(self) -> bool:
        return any(s.gen is not None for s in (self.a, self.b))

    def run(self, prompt: str | None = None) -> bool:
        if self.running or self.diff_worker is not None:
            return False
        text = (self.prompt.toPlainText() if prompt is None else prompt).strip()
        if not text:
            return False
        messages = self.sampling.system_messages() + [{"role": "user", "content": text}]
        params = self.sampling.params()
        mixes = [self.mix_of(s) for s in (self.a, self.b)]
        # Submit both before returning to the event loop: the scheduler admits them
        # together and runs them in one batch.
        gens = self.bridge.chat_many(
            [
                (messages, params, mix, side.title.text())
                for side, mix in zip((self.a, self.b), mixes)
            ]
        )
        self._messages = messages
        self._clear_diff()
        for side, gen in zip((self.a, self.b), gens):
            side.text, side.done, side.gen = "", None, gen
            side.preset = side.combo.currentText()
            side.meta.setText("generating…")
            gen.token.connect(lambda t, s=side: self._token(s, t))
            gen.finished.connect(lambda d, s=side: self._done(s, d))
        self._preview()
        self._render()
        self.run_btn.setEnabled(not self.running)
        self.stop_btn.setEnabled(self.running)
        return self.running

    def stop(self) -> None:
        for s in (self.a, self.b):
            if s.gen is not None:
                s.gen.cancel()

    def _token(self, side: Side, text: str) -> None:
        side.text += text
        if not self._timer.isActive():
            self._timer.start()

    def _done(self, side: Side, done) -> None:
        side.gen, side.done = None, done
        side.text = done.content or side.text
        t = done.timings.as_dict()
        side.meta.setText(
            f"{t['predicted_n']} tokens · {t['predicted_per_second']:.1f} tok/s · "
            f"stop: {done.stop_type}" + (f" · {done.error}" if done.error else "")
        )
        self._render()
        if not self.running:
            self.run_btn.setEnabled(True)
            self.stop_btn.setEnabled(False)
            self.diff_btn.setEnabled(
                all(s.done.tokens and not s.done.error for s in (self.a, self.b))
            )
            self.finished.emit()

    # -- the diff view ------------------------------------------------------------------
    def _clear_diff(self) -> None:
        for s in (self.a, self.b):
            s.own = s.other = None
            s.marks = []
            s.view.spans, s.view.tips = [], []
        self.diff_btn.blockSignals(True)
        self.diff_btn.setChecked(False)
        self.diff_btn.blockSignals(False)
        self.diff_btn.setEnabled(False)
        self.diff_hint.clear()

    def _diff_toggled(self, on: bool) -> None:
        if not on:
            self.diff_hint.clear()
            self._render()
        elif self.a.own is not None:
            self._show_diff()
        else:
            self._score()

    def _score(self) -> None:
        """Score both replies under both mixes on a worker (the forward passes run on
        the engine thread; the GUI never waits for them)."""
        engine, messages = self.bridge.engine, self._messages
        replies = [s.done.tokens for s in (self.a, self.b)]
        # the mix keys the sides ran with (a merge method's key carries its method, a
        # steered key its vectors: as a Mix, so the score is steered as the reply was)
        mixes = [key_mix(s.done.mix) for s in (self.a, self.b)]

        def work():
            prompt = engine.chat_prompt(messages)
            start = len(prompt)
            jobs = [(prompt + r, m, start) for r in replies for m in mixes]  # A|a A|b B|a B|b
            return engine.score_many(jobs, top_k=DIFF_TOP_K)

        self.diff_hint.setText("Diff: scoring each reply under both mixes…")
        self.diff_btn.setEnabled(False)
        self.run_btn.setEnabled(False)
        worker = self.diff_worker = self.bridge.run(work, name="mixdesk-diff")
        worker.returned.connect(self._scored)
        worker.errored.connect(self._score_failed)
        worker.finished.connect(self._score_over)
        worker.start()

    def _scored(self, got: list[list[TokenScore]]) -> None:
        a_a, a_b, b_a, b_b = got
        self.a.own, self.a.other = a_a, a_b
        self.b.own, self.b.other = b_b, b_a
        for s in (self.a, self.b):
            s.marks = disagreements(s.own, s.other)
        if self.diff_btn.isChecked():
            self._show_diff()

    def _score_failed(self, e: Exception) -> None:
        self.diff_hint.setText(f"Diff failed: {e}")
        self.diff_btn.blockSignals(True)
        self.diff_btn.setChecked(False)
        self.diff_btn.blockSignals(False)

    def _score_over(self) -> None:
        self.diff_worker = None
        self.diff_btn.setEnabled(not self.running)
        self.run_btn.setEnabled(not self.running)

    def _show_diff(self) -> None:
        names = {a: s.info["name"] for a, s in self.mixer.strips.items()}
        labels = {
            s: side_label(s.title.text(), s.preset, s.done.mix, names) for s in (self.a, self.b)
        }
        for s, o in ((self.a, self.b), (self.b, self.a)):
            eog = self.bridge.engine.tokenizer.is_eog
            # a line break gets a visible ↵ so that, when the mixes disagree on it, it
            # can be seen marked and hovered like any other token
            texts = [END_MARK if eog(t.token) else t.text.replace("\n", "↵\n") for t in s.own]
            tips = [
                diff_tooltip(i, own, other, labels[s], labels[o])
                for i, (own, other) in enumerate(zip(s.own, s.other))
            ]
            s.view.show_tokens(texts, s.marks, tips)
        na, nb = sum(self.a.marks), sum(self.b.marks)
        self.diff_hint.setText(
            f"Diff: the two mixes' top-1 differ at {na} of {len(self.a.marks)} tokens of A's "
            f"reply and {nb} of {len(self.b.marks)} of B's (highlighted); hover a token for "
            "both mixes' top-5."
        )

    def _render(self) -> None:
        if self.diff_btn.isChecked() and self.a.own is not None:
            self._show_diff()  # the theme changed: marks in its colour
            return
        for s in (self.a, self.b):
            s.view.spans, s.view.tips = [], []  # the Markdown view has no token tooltips
            codes: list[str] = []  # no Copy links here: the chat has them
            s.view.setHtml(
                render_md(s.text or ("…" if s.gen else ""), palette_colors(s.view), codes)
            )


def side_label(title: str, preset: str, mix, names) -> str:
    """One side of A/B as the Diff tooltips name it: "A · warm: pirate ×0.50"; the
    base model is said once ("(base model, no adapters): base model (no adapters)"
    said it twice), and the current desk is called the desk."""
    shown = mix_label(mix, names)  # a {id: scale}, a Mix or a mix key, with its vectors
    if preset == BASE or shown == mix_text({}, {}):  # "base model (no adapters)"
        return f"{title} · {shown}"
    source = "the desk" if preset in (CURRENT, "") else preset
    return f"{title} · {source}: {shown}"


def diff_tooltip(i: int, own: TokenScore, other: TokenScore, own_label: str, other_label: str):
    """A token's tooltip: the token, then each mix's top-k at its position (rich text,
    every model string escaped)."""

    def shown(text: str) -> str:
        return html.escape(repr(text)[1:-1] if text else "∅")

    def column(label: str, sc: TokenScore) -> str:
        rows = "".join(
            f"<tr><td>{'<b>' if c.id == own.token else ''}{shown(c.text)}"
            f"{'</b>' if c.id == own.token else ''}</td>"
            f"<td align='right'>{c.logprob:.2f}</td></tr>"
            for c in sc.top
        )
        return (
            f"<p><b>{html.escape(label)}</b>: {shown_token} {sc.logprob:.2f}</p>"
            f"<table cellspacing='4'>{rows}</table>"
        )

    shown_token = shown(own.text)
    verdict = "top-1 differs" if own.top1 != other.top1 else "same top-1"
    return (
        f"<qt><p>token {i + 1}: <b>{shown_token}</b> · {verdict}</p>"
        f"{column(own_label, own)}{column(other_label, other)}</qt>"
    )
