"""The X/Y grid tab (issue #21): one prompt under X × Y mixes, all submitted at once so
the engine runs them as one batch, streaming into a grid of cards.

Each axis varies the scale of one adapter, a preset, the merge method or the seed,
over the values typed in its field. The cells, their validation and the exports are core/grid.py's;
this pane only builds the spec from its widgets, submits the cells through
``EngineBridge.chat_many`` (the A/B compare path) and shows them.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from core import grid as G

from .bridge import EngineBridge, Generation
from .desk import mix_label
from .mixer import MixerPanel
from .sampling import SamplingForm
from .util import ElidedLabel, prompt_row

NONE = "(none)"
KINDS = {
    "Scale of": "scale",
    "Vector": "vector",
    "Preset": "preset",
    "Method": "method",
    "Seed": "seed",
}
DEFAULTS = {
    "scale": "0, 0.25, 0.5, 0.75, 1",
    "vector": "0, 0.5, 1",
    "seed": "1, 2",
    "preset": "",
    "method": "linear, ties, dare_ties",
}


def parse_values(kind: str, text: str) -> tuple:
    """The values typed in an axis field: comma-separated numbers (scale), integers
    (seed), preset names or merge methods (each at its default density and rank).
    Bad values are a GridError naming them."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if kind == "preset":
        return tuple(items)
    if kind == "method":
        return tuple(G.merge_spec(t, "method") for t in items)
    out = []
    for t in items:
        try:
            out.append(int(t) if kind == "seed" else float(t))
        except ValueError:
            what = "an integer seed" if kind == "seed" else "a number"
            raise G.GridError(f"{t!r} is not {what}") from None
    return tuple(out)


class AxisPicker(QWidget):
    """One axis: what varies (combo; an adapter combo for "Scale of") and its values."""

    changed = Signal()

    def __init__(self, label: str, optional: bool, parent: QWidget | None = None):
        super().__init__(parent)
        self.optional = optional
        self.kind = QComboBox()
        self.kind.addItems(([NONE] if optional else []) + list(KINDS))
        self.adapter = QComboBox()
        self.adapter.setMinimumWidth(110)
        self.vector = QComboBox()  # kind "vector": which control vector's scale varies
        self.vector.setMinimumWidth(110)
        self.values = QLineEdit()
        self.values.setPlaceholderText("values, comma-separated")
        title = QLabel(label)
        title.setObjectName("sectionTitle")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(title)
        lay.addWidget(self.kind)
        lay.addWidget(self.adapter)
        lay.addWidget(self.vector)
        lay.addWidget(self.values, 1)
        self._last_kind = ""
        self.kind.currentTextChanged.connect(self._kind_changed)
        self.values.textChanged.connect(lambda _: self.changed.emit())
        self.adapter.currentIndexChanged.connect(lambda _: self.changed.emit())
        self.vector.currentIndexChanged.connect(lambda _: self.changed.emit())
        self._kind_changed()

    def kind_code(self) -> str | None:
        return KINDS.get(self.kind.currentText())

    def _kind_changed(self, *_) -> None:
        kind = self.kind_code()
        self.adapter.setVisible(kind == "scale")
        self.vector.setVisible(kind == "vector")
        self.values.setEnabled(kind is not None)
        # a kind's example values replace the field when it still shows another's
        if kind and (not self.values.text() or self.values.text() in DEFAULTS.values()):
            self.values.setText(DEFAULTS[kind])
        elif kind is None:
            self.values.clear()
        self.changed.emit()

    def set_adapters(self, adapters: list[dict]) -> None:
        cur = self.adapter.currentData()
        self.adapter.blockSignals(True)
        self.adapter.clear()
        for a in adapters:
            self.adapter.addItem(a["name"], a["id"])
        i = self.adapter.findData(cur)
        self.adapter.setCurrentIndex(max(i, 0))
        self.adapter.blockSignals(False)

    def set_vectors(self, vectors: list[dict]) -> None:
        """The control vectors a "Vector" axis can vary (Engine.control_vectors())."""
        cur = self.vector.currentData()
        self.vector.blockSignals(True)
        self.vector.clear()
        for v in vectors:
            self.vector.addItem(v["name"], v["id"])
        self.vector.setCurrentIndex(max(self.vector.findData(cur), 0))
        self.vector.blockSignals(False)

    def set_axis(
        self, kind: str | None, values: str, adapter: int | None = None, vector: int | None = None
    ) -> None:
        """Set from code (tests, restoring): kind "scale"/"vector"/"preset"/"seed" or None."""
        names = {v: k for k, v in KINDS.items()}
        self.kind.setCurrentText(names[kind] if kind else NONE)
        if adapter is not None:
            self.adapter.setCurrentIndex(max(self.adapter.findData(adapter), 0))
        if vector is not None:
            self.vector.setCurrentIndex(max(self.vector.findData(vector), 0))
        self.values.setText(values)

    def axis(self) -> G.Axis | None:
        kind = self.kind_code()
        if kind is None:
            return None
        adapter = self.adapter.currentData() if kind == "scale" else None
        if kind == "scale" and adapter is None:
            raise G.GridError("load an adapter first: a scale axis varies one adapter")
        if kind == "vector":
            if self.vector.currentData() is None:
                raise G.GridError("load a control vector first: a vector axis varies one")
            values = parse_values(kind, self.values.text())
            vid, name = self.vector.currentData(), self.vector.currentText()
            return G.Axis(kind, values, vector=vid, name=name)
        return G.Axis(kind, parse_values(kind, self.values.text()), adapter)


class Card(QFrame):
    """One cell: its axis labels, its mix, the reply as it streams, and its numbers."""

    use_mix = Signal(object)  # the cell's mix

    def __init__(
        self, cell: G.Cell, shown_mix: str, parent: QWidget | None = None, buttons: bool = True
    ):
        """``buttons``: False for the PNG export's copy, which has nothing to click."""
        super().__init__(parent)
        self.setObjectName("gridCard")
        self.cell = cell
        self.text = ""
        self.done = None
        self.gen: Generation | None = None
        title = " · ".join(t for t in (cell.x_label, cell.y_label) if t)
        # elided to the card's width (it widened the card, then clipped): all of it in
        # the tooltip
        self.title = ElidedLabel(title)
        self.title.setToolTip(title)
        self.title.setObjectName("cardTitle")
        self.mix = QLabel(shown_mix)
        self.mix.setObjectName("hint")
        self.mix.setWordWrap(True)
        self.reply = QLabel("…")
        self.reply.setWordWrap(True)
        self.reply.setTextFormat(Qt.PlainText)
        self.reply.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.reply.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        self.reply.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Expanding)
        self.meta = QLabel("queued")
        self.meta.setObjectName("hint")
        self.meta.setWordWrap(True)
        self.use = QPushButton("Use this mix")
        self.use.setToolTip("Put this cell's mix on the desk")
        self.use.clicked.connect(lambda: self.use_mix.emit(self.cell.mix))  # with its method
        # the numbers on a line of their own: in a narrow card they would squeeze the button
        bottom = QHBoxLayout()
        bottom.addStretch(1)
        if buttons:
            bottom.addWidget(self.use)
        else:
            self.use.setParent(None)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 8, 10, 8)
        lay.addWidget(self.title)
        lay.addWidget(self.mix)
        lay.addWidget(self.reply, 1)
        lay.addWidget(self.meta)
        lay.addLayout(bottom)
        self.setMinimumWidth(170)  # three columns fit the tab at 1280 px

    def token(self, text: str) -> None:
        if not self.text:
            self.meta.setText("generating…")
        self.text += text
        self.reply.setText(self.text)

    def finish(self, done) -> None:
        self.gen, self.done = None, done
        self.text = done.content or self.text
        self.reply.setText(self.text)
        r = G.CellResult.from_done(self.cell, done)
        self.meta.setText(
            f"{r.tokens} tokens · {r.tok_s:.1f} tok/s · stop: {r.stop}"
            + (f" · {r.error}" if r.error else "")
        )


class GridPane(QWidget):
    finished = Signal()  # every cell done
    message = Signal(str)

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
        self.cards: list[Card] = []
        self.spec: G.GridSpec | None = None
        self.names: dict[int, str] = {}

        self.x = AxisPicker("X", optional=False)
        self.y = AxisPicker("Y", optional=True)
        self.export_btn = QToolButton(text="Export")
        self.export_btn.setPopupMode(QToolButton.InstantPopup)
        menu = QMenu(self.export_btn)
        menu.addAction("Markdown…", lambda: self._export_dialog("md"))
        menu.addAction("CSV…", lambda: self._export_dialog("csv"))
        menu.addAction("PNG image…", lambda: self._export_dialog("png"))
        self.export_btn.setMenu(menu)
        self.export_btn.setEnabled(False)
        self.prompt, self.run_btn, self.stop_btn, row = prompt_row(
            self, "One prompt, X × Y mixes", "Run grid", self.run, self.stop, self.export_btn
        )
        self.status = QLabel()
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)

        self.grid_host = QWidget()
        self.grid_host.setObjectName("gridHost")
        self.grid = QGridLayout(self.grid_host)
        self.grid.setContentsMargins(4, 4, 4, 4)
        self.grid.setSpacing(8)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.grid_host)
        scroll.setFrameShape(QScrollArea.NoFrame)

        axes = QVBoxLayout()
        axes.addWidget(self.x)
        axes.addWidget(self.y)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(axes)
        lay.addWidget(self.status)
        lay.addWidget(scroll, 1)
        lay.addLayout(row)

        bridge.adapters_changed.connect(lambda _: self._adapters_changed())
        bridge.vectors_changed.connect(lambda _: self._adapters_changed())
        self._adapters_changed()

    def _adapters_changed(self) -> None:
        adapters = self.bridge.engine.adapters()
        vectors = self.bridge.engine.control_vectors()
        for picker in (self.x, self.y):
            picker.set_adapters(adapters)
            picker.set_vectors(vectors)

    def strip_names(self) -> dict:
        """Names by the desk's strip keys (adapters and VecKey vectors): mix captions."""
        return {k: s.info["name"] for k, s in self.mixer.strips.items()}

    # -- the spec ----------------------------------------------------------------------
    def build_spec(self, text: str) -> G.GridSpec:
        """The grid the widgets describe; GridError with the reason if it cannot run."""
        self.names = {a["id"]: a["name"] for a in self.bridge.engine.adapters()}
        x, y = self.x.axis(), self.y.axis()
        presets = {}
        for axis in (x, y):
            for name in axis.values if axis and axis.kind == "preset" else ():
                mix = self.mixer.mix_for_preset(name)
                if mix is not None:
                    presets[name] = mix
        spec = G.GridSpec(
            x,
            y,
            self.sampling.params(),
            messages=self.sampling.system_messages() + [{"role": "user", "content": text}],
            presets=presets,
        )
        G.check_spec(spec, self.names)
        return spec

    # -- running -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return any(c.gen is not None for c in self.cards)

    def run(self, prompt: str | None = None) -> bool:
        if self.running:
            return False
        text = (self.prompt.toPlainText() if prompt is None else prompt).strip()
        if not text:
            self.status.setText("Type a prompt first.")
            return False
        try:
            spec = self.build_spec(text)
        except G.GridError as e:
            self.status.setText(str(e))
            return False
        self.spec = spec
        cells = G.cells(spec, self.mixer.desk_mix(), self.names)
        self._layout_cards(spec, cells)
        # every cell submitted in one submit_many: admitted in the same scheduler step
        # (up to the slot count), so the grid runs as one batch
        gens = self.bridge.chat_many([(spec.messages, c.params, c.mix, c.index) for c in cells])
        for card, gen in zip(self.cards, gens):
            card.gen = gen
            gen.token.connect(card.token)
            gen.finished.connect(lambda d, c=card: self._done(c, d))
        cols, rows = spec.shape
        slots = self.bridge.engine.n_parallel
        waves = -(-len(cells) // slots)
        self.status.setText(
            f"{len(cells)} cells ({cols} × {rows}) in one batch"
            + (f" of {slots} slots: {waves} waves" if waves > 1 else "")
        )
        self.run_btn.setEnabled(False)
        self.stop_btn.setEnabled(True)
        self.export_btn.setEnabled(False)
        return True

    def _layout_cards(self, spec: G.GridSpec, cells: list[G.Cell]) -> None:
        while self.grid.count():
            w = self.grid.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        self.cards = self._fill(self.grid, spec, cells, buttons=True)
        for card in self.cards:
            card.use_mix.connect(self.use_mix)

    def _fill(
        self, grid: QGridLayout, spec: G.GridSpec, cells: list[G.Cell], buttons: bool
    ) -> list[Card]:
        """Axis headers and one card per cell in ``grid`` (the tab's, or the export's)."""
        cards = []
        cols, rows = spec.shape
        # headers: X labels on top, Y labels on the left
        for i in range(cols):
            h = QLabel(spec.x.label(i, self.names))
            h.setObjectName("gridHeader")
            h.setAlignment(Qt.AlignCenter)
            grid.addWidget(h, 0, i + 1)
        if spec.y:
            for j in range(rows):
                h = QLabel(spec.y.label(j, self.names))
                h.setObjectName("gridHeader")
                h.setWordWrap(True)
                h.setMaximumWidth(70)
                grid.addWidget(h, j + 1, 0)
        for c in cells:
            card = Card(c, mix_label(c.mix, self.strip_names()), buttons=buttons)
            grid.addWidget(card, c.y + 1, c.x + 1)
            cards.append(card)
        for i in range(cols):
            grid.setColumnStretch(i + 1, 1)
        return cards

    def stop(self) -> None:
        for c in self.cards:
            if c.gen is not None:
                c.gen.cancel()

    def _done(self, card: Card, done) -> None:
        card.finish(done)
        if not self.running:
            self.run_btn.setEnabled(True)
            self.stop_btn.setEnabled(False)
            self.export_btn.setEnabled(True)
            self.finished.emit()

    def use_mix(self, mix: dict) -> None:
        self.mixer.use_mix(mix)
        self.message.emit("The desk now plays " + mix_label(mix, self.strip_names()))

    # -- exports ---------------------------------------------------------------------------
    def results(self) -> list[G.CellResult]:
        return [G.CellResult.from_done(c.cell, c.done) for c in self.cards if c.done is not None]

    def export(self, kind: str, path: str | Path) -> Path:
        """Write the grid as Markdown ("md"), CSV ("csv") or a PNG of the cards ("png")."""
        path = Path(path)
        if kind == "png":
            view = self.export_view()
            try:
                if not view.grab().save(str(path), "PNG"):
                    raise OSError(f"could not write {path}")
            finally:
                view.close()
                view.deleteLater()
            return path
        prompt = self.spec.prompt_text if self.spec else ""
        if kind == "csv":
            text = G.to_csv(prompt, self.results(), self.names)
        else:
            text = G.to_markdown(prompt, self.results(), self.names, self.spec)
        path.write_text(text, encoding="utf-8", newline="")
        return path

    def export_header(self) -> str:
        """The PNG's first lines: the prompt and the sampling settings it ran with."""
        if self.spec is None:
            return ""
        return f"Prompt: {self.spec.prompt_text}\nSampling: {G.params_text(self.spec.params)}"

    def export_view(self) -> QWidget:
        """What the PNG draws, built apart from the tab: the prompt and settings on top,
        then the cards as they ended, without their "Use this mix" buttons. Shown off
        screen at the tab's width; the caller closes it."""
        view = QWidget()
        view.setObjectName("gridExport")
        view.setAttribute(Qt.WA_DontShowOnScreen)
        lay = QVBoxLayout(view)
        head = QLabel(self.export_header())
        head.setObjectName("cardTitle")
        head.setWordWrap(True)
        head.setTextFormat(Qt.PlainText)
        lay.addWidget(head)
        grid = QGridLayout()
        lay.addLayout(grid)
        if self.spec is not None:
            copies = self._fill(grid, self.spec, [c.cell for c in self.cards], buttons=False)
            for copy, card in zip(copies, self.cards):
                if card.done is not None:
                    copy.finish(card.done)
                else:
                    copy.reply.setText(card.text)
        view.show()
        width = max(self.grid_host.width(), view.minimumSizeHint().width())
        height = lay.totalHeightForWidth(width) if lay.hasHeightForWidth() else -1
        view.resize(width, max(height, view.sizeHint().height()))
        lay.activate()
        return view

    def _export_dialog(self, kind: str) -> None:
        filters = {"md": "Markdown (*.md)", "csv": "CSV (*.csv)", "png": "PNG image (*.png)"}
        start = str(Path(self.mixer.settings.get("export_dir") or Path.home()) / f"grid.{kind}")
        path, _ = QFileDialog.getSaveFileName(self, "Export the grid", start, filters[kind])
        if not path:
            return
        try:
            self.export(kind, path)
        except OSError as e:
            self.status.setText(f"Could not export the grid: {e}")
            return
        self.message.emit(f"Exported the grid to {path}")
