"""A/B compare: one prompt under two mixes (preset A, preset B), both submitted at
once so the engine batches them, replies streaming side by side."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from .bridge import EngineBridge, Generation
from .chat import palette_colors
from .markdown import render as render_md
from .mixer import MixerPanel
from .sampling import SamplingForm
from .util import format_mix

CURRENT = "(current desk mix)"
BASE = "(base model, no adapters)"


class Side:
    def __init__(self, label: str):
        self.combo = QComboBox()
        self.combo.setMinimumWidth(160)
        self.title = QLabel(label)
        self.title.setObjectName("sectionTitle")
        self.mix_label = QLabel()
        self.mix_label.setObjectName("hint")
        self.mix_label.setWordWrap(True)
        self.view = QTextBrowser()
        self.meta = QLabel()
        self.meta.setObjectName("hint")
        self.gen: Generation | None = None
        self.text = ""
        self.done = None


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

        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("One prompt, two mixes…   (Ctrl+Enter to run)")
        self.prompt.setMaximumHeight(80)
        self.run_btn = QPushButton("Run A/B")
        self.run_btn.setObjectName("primaryButton")
        self.run_btn.clicked.connect(lambda: self.run())
        self.stop_btn = QPushButton("Stop")
        self.stop_btn.setObjectName("stopButton")
        self.stop_btn.clicked.connect(self.stop)
        self.stop_btn.setEnabled(False)

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
            side.combo.currentTextChanged.connect(self._preview)
        grid.setRowStretch(2, 1)
        row = QHBoxLayout()
        row.addWidget(self.prompt, 1)
        col = QVBoxLayout()
        col.addWidget(self.run_btn)
        col.addWidget(self.stop_btn)
        row.addLayout(col)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(grid, 1)
        lay.addLayout(row)

        QShortcut(
            QKeySequence("Ctrl+Return"),
            self,
            lambda: self.run(),
            context=Qt.WidgetWithChildrenShortcut,
        )
        QShortcut(QKeySequence("Escape"), self, self.stop, context=Qt.WidgetWithChildrenShortcut)
        self._timer = QTimer(self, singleShot=True, interval=60)
        self._timer.timeout.connect(self._render)
        mixer.presets_changed.connect(self.refresh_presets)
        bridge.adapters_changed.connect(lambda _: self._preview())
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
        if name == BASE:
            return {aid: 0.0 for aid in self.mixer.strips}
        return self.mixer.mix_for_preset("" if name in (CURRENT, "") else name)

    def _preview(self, *_) -> None:
        names = {a: s.info["name"] for a, s in self.mixer.strips.items()}
        for side in (self.a, self.b):
            mix = self.mix_of(side)
            side.mix_label.setText("mix: " + (format_mix(mix, names) if mix is not None else "?"))
        if self.a.combo.currentText():
            self.mixer.settings.set(
                "compare", {"a": self.a.combo.currentText(), "b": self.b.combo.currentText()}
            )

    @property
    def running(self) -> bool:
        return any(s.gen is not None for s in (self.a, self.b))

    def run(self, prompt: str | None = None) -> bool:
        if self.running:
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
        for side, gen in zip((self.a, self.b), gens):
            side.text, side.done, side.gen = "", None, gen
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
            self.finished.emit()

    def _render(self) -> None:
        for s in (self.a, self.b):
            codes: list[str] = []  # no Copy links here: the chat has them
            s.view.setHtml(
                render_md(s.text or ("…" if s.gen else ""), palette_colors(s.view), codes)
            )
