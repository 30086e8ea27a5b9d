"""File > New control vector…: make a control vector from contrasting prompt pairs
(core/lora/vector_train.py) and load it into the session.

The user picks a built-in template (its pairs fill the table) or writes pairs, edits
the shared reply starts, picks the method and the scale it is loaded at. Making runs
on a Worker (ui/workers.py) whose abort event is the training's cancel; each forward
runs on the engine thread between scheduler steps, so chats keep running. On success
the file is in the data dir's adapters/ folder and the vector is loaded at the chosen
scale: every request that names no vectors of its own runs under it (as a
``--control-vector-scaled`` vector would).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from core.errors import UserError
from core.lora.control import SCALE_MAX
from core.lora.vector_train import (
    METHODS,
    SUFFIXES,
    TEMPLATES,
    TrainCancelled,
    check_name,
    load_made,
    make_spec,
    middle_layers,
    train_on_engine,
)
from core.paths import data_dir

from .workers import Aborted, Worker

CUSTOM = "Custom pairs"


class VectorTrainDialog(QDialog):
    progressed = Signal(int, int)  # (examples done, in all), from the worker thread
    made = Signal(int, str)  # (vector id, file) once loaded
    cancelled = Signal()  # a run stopped by Cancel: nothing written

    def __init__(self, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("New control vector")
        self.bridge = bridge
        self.worker: Worker | None = None

        self.template = QComboBox()
        self.template.addItem(CUSTOM, None)
        for key, t in TEMPLATES.items():
            self.template.addItem(t.label, key)
        self.template.currentIndexChanged.connect(self._template_chosen)
        self.pairs = QTableWidget(0, 2)
        self.pairs.setHorizontalHeaderLabels(["Positive (scale > 0)", "Negative (scale < 0)"])
        self.pairs.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        add, remove = QPushButton("Add pair"), QPushButton("Remove pair")
        add.clicked.connect(lambda: self._add_pair("", ""))
        remove.clicked.connect(lambda: self.pairs.removeRow(max(self.pairs.currentRow(), 0)))
        self.suffixes = QPlainTextEdit("\n".join(s for s in SUFFIXES if s))
        self.suffixes.setToolTip(
            "Starts of the assistant's reply, one per line, shared by both sides of every "
            "pair (the prompt as it is, with no reply started, is always one of them)"
        )
        self.method = QComboBox()
        self.method.addItems(METHODS)
        self.method.setToolTip(
            "pca: first principal component of the pair differences; mean: their mean"
        )
        self.name = QLineEdit("happy-sad")
        # the layers written: the middle band by default (middle_layers says why)
        n = bridge.engine.config.n_layers if bridge.engine.config is not None else 2
        lo, hi = middle_layers(n)
        self.first, self.last = QSpinBox(), QSpinBox()
        for box, v in ((self.first, lo), (self.last, hi)):
            box.setRange(1, max(1, n - 1))
            box.setValue(v)
        layers = QHBoxLayout()
        layers.addWidget(self.first)
        layers.addWidget(QLabel("to"))
        layers.addWidget(self.last)
        layers.addStretch(1)
        self.scale = QDoubleSpinBox()
        self.scale.setRange(-SCALE_MAX, SCALE_MAX)
        self.scale.setSingleStep(0.1)
        self.scale.setValue(0.5)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.make_btn = QPushButton("Make")
        self.make_btn.setDefault(True)
        self.make_btn.clicked.connect(self.start)
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.clicked.connect(self.cancel)

        form = QFormLayout()
        form.addRow("Template", self.template)
        form.addRow("Reply starts", self.suffixes)
        form.addRow("Method", self.method)
        form.addRow("Layers", layers)
        form.addRow("Name", self.name)
        form.addRow("Load at scale", self.scale)
        row = QHBoxLayout()
        row.addWidget(add)
        row.addWidget(remove)
        row.addStretch(1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.progress, 1)
        buttons.addWidget(self.make_btn)
        buttons.addWidget(self.cancel_btn)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.pairs, 1)
        lay.addLayout(row)
        lay.addWidget(self.status)
        lay.addLayout(buttons)
        self.progressed.connect(self._progressed)
        self.template.setCurrentIndex(1)  # the first built-in: a vector in one click
        self.resize(640, 520)

    # -- the form ---------------------------------------------------------------------------
    def _add_pair(self, pos: str, neg: str) -> None:
        r = self.pairs.rowCount()
        self.pairs.insertRow(r)
        self.pairs.setItem(r, 0, QTableWidgetItem(pos))
        self.pairs.setItem(r, 1, QTableWidgetItem(neg))

    def _template_chosen(self, _index: int) -> None:
        key = self.template.currentData()
        if key is None:
            return
        self.pairs.setRowCount(0)
        for p in TEMPLATES[key].pairs:
            self._add_pair(p.positive, p.negative)
        self.name.setText(key)

    def table_pairs(self) -> list[dict]:
        def text(r: int, c: int) -> str:
            item = self.pairs.item(r, c)
            return item.text() if item is not None else ""

        rows = [(text(r, 0), text(r, 1)) for r in range(self.pairs.rowCount())]
        return [{"positive": p, "negative": n} for p, n in rows if p.strip() or n.strip()]

    def suffix_list(self) -> list[str]:
        return [""] + [s for s in self.suffixes.toPlainText().splitlines() if s.strip()]

    # -- making ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.worker is not None and self.worker.running

    def start(self) -> None:
        """Check the form (a bad one: the reason below it, nothing runs), then make."""
        if self.running:
            return
        try:
            suffixes = self.suffix_list()
            layers = [self.first.value(), self.last.value()]
            spec = make_spec(self.table_pairs(), None, suffixes, self.method.currentText(), layers)
            name = check_name(self.name.text().strip())
            dest = data_dir() / "adapters" / f"{name}.gguf"
            if dest.exists():
                raise UserError(f"{dest.name} exists already in {dest.parent}: pick another name")
            self.bridge.engine.require_ready()
        except UserError as e:
            self.status.setText(str(e))
            return
        self.progress.setRange(0, spec.n_examples)
        self.progress.setValue(0)
        self.status.setText(f"Making {name} from {spec.n_examples} examples…")
        self._busy(True)
        w = self.worker = self.bridge.run(
            self._work, spec, dest, self.scale.value(), name="mixdesk-vector"
        )
        w.returned.connect(self._done)
        w.errored.connect(self._failed)
        w.aborted.connect(self._aborted)
        w.start()

    def _work(self, spec, dest: Path, scale: float, abort) -> tuple[int, str]:
        """On the worker thread: make, write, load; Aborted once Cancel was pressed."""
        eng = self.bridge.engine
        try:
            path = train_on_engine(
                eng, spec, dest, lambda i, n: self.progressed.emit(i, n), abort.is_set
            )
            # not loaded (and the file gone) if Cancel came while it was written
            vid = load_made(path, lambda p: eng.add_control_vector(p, scale), abort.is_set)
        except TrainCancelled:
            raise Aborted() from None
        return vid, str(path)

    def _progressed(self, done: int, total: int) -> None:
        self.progress.setValue(done)

    def _done(self, got) -> None:
        vid, path = got
        self._busy(False)
        self.status.setText(
            f"Loaded {Path(path).stem} (vector {vid}) at scale {self.scale.value():g}: "
            f"replies are steered by it. File: {path}"
        )
        self.made.emit(vid, path)

    def _failed(self, e: BaseException) -> None:
        self._busy(False)
        self.status.setText(f"Not made: {e}")

    def _aborted(self) -> None:
        self._busy(False)
        self.progress.setValue(0)
        self.status.setText("Cancelled: no control vector was written.")
        self.cancelled.emit()

    def _busy(self, on: bool) -> None:
        self.make_btn.setEnabled(not on)
        boxes = (self.template, self.pairs, self.suffixes, self.method, self.first, self.last)
        for w in (*boxes, self.name, self.scale):
            w.setEnabled(not on)

    def cancel(self) -> None:
        """While making: stop at the next example. Otherwise: close."""
        if self.running:
            self.worker.abort()
        else:
            self.reject()

    def reject(self) -> None:  # Escape and the close button cancel a run first
        if self.running:
            self.worker.abort()
            return
        super().reject()
