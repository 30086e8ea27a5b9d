"""Adapter manager: add (file dialog, PEFT folder, drag and drop) and remove LoRAs,
with each adapter's rank, alpha, targets, size, task name and base-model check.
A file that fails to load becomes a red row with the engine's message; the
adapters already loaded keep working."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from core.serve.events import ModelLoaded
from core.settings import Settings

from . import theme
from .bridge import EngineBridge
from .util import FileDropMixin, file_size, human_bytes, is_model_gguf

COLUMNS = ("Adapter", "Rank", "α", "Size", "Task", "Check", "Targets")
SIZE_COL, BASE_COL, TARGETS_COL = 3, 5, 6
ERROR_ROLE = Qt.UserRole + 1


def problem_text(message: str) -> str:
    """The engine's "adapter x.gguf: why" for a line that already says "Adapter":
    "x.gguf: why" (never "Adapter not loaded: adapter x.gguf: ...")."""
    return message[len("adapter ") :] if message.startswith("adapter ") else message


def reason_text(path: str, message: str) -> str:
    """The reason alone, for a row whose first column already shows the file name."""
    text = problem_text(message)
    for prefix in (f"{Path(path).name}: ", f"{path}: "):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


def compact_targets(targets: list[str]) -> str:
    """['attn_k', 'attn_q', 'ffn_up'] -> 'attn q k · ffn up' (short enough for a column)."""
    order = ["q", "k", "v", "output", "gate", "up", "down"]
    groups: dict[str, list[str]] = {}
    for t in targets:
        head, _, tail = t.partition("_")
        groups.setdefault(head if tail else t, []).append(tail)
    parts = []
    for head, tails in groups.items():
        tails = sorted((x for x in tails if x), key=lambda x: order.index(x) if x in order else 99)
        parts.append(" ".join([head] + [("o" if x == "output" else x) for x in tails]))
    return " · ".join(parts)


class AdapterPanel(FileDropMixin, QWidget):
    message = Signal(str)
    open_model_requested = Signal(str)  # a model file added as an adapter, to open instead

    def __init__(self, bridge: EngineBridge, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.settings = settings
        self.errors: dict[str, str] = {}  # path -> message of adapters that failed
        self._adapters: list[dict] = []
        self._model_name = ""
        self.setAcceptDrops(True)

        title = QLabel("Adapters")
        title.setObjectName("sectionTitle")
        self.add_btn = QPushButton("Add GGUF…")
        self.add_btn.clicked.connect(self._add_files)
        self.add_peft_btn = QPushButton("Add PEFT…")
        self.add_peft_btn.setToolTip("Add a PEFT adapter folder (adapter_config.json + weights)")
        self.add_peft_btn.clicked.connect(self._add_folder)
        self.remove_btn = QPushButton("Remove")
        self.remove_btn.clicked.connect(self.remove_selected)
        top = QHBoxLayout()
        top.addWidget(title)
        top.addStretch(1)
        for b in (self.add_btn, self.add_peft_btn, self.remove_btn):
            top.addWidget(b)

        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(list(COLUMNS))
        self.tree.setRootIsDecorated(False)
        self.tree.setAlternatingRowColors(True)
        self.tree.setSelectionMode(QAbstractItemView.ExtendedSelection)
        self.tree.setWordWrap(False)
        hdr = self.tree.header()
        hdr.setSectionResizeMode(QHeaderView.ResizeToContents)
        # Targets (the last) takes the room left, elided (the full list is its tooltip):
        # sized to its contents it made the list scroll sideways in a 1024x700 window.
        # A stretched last section never gets narrower than its size when the stretch
        # was turned on (100 px by default), so that size is made the minimum first.
        hdr.setSectionResizeMode(TARGETS_COL, QHeaderView.Interactive)
        hdr.resizeSection(TARGETS_COL, hdr.minimumSectionSize())
        hdr.setStretchLastSection(True)
        self.tree.setTextElideMode(Qt.ElideRight)
        self.tree.headerItem().setToolTip(2, "LoRA alpha: the effective scale is scale × α / rank")
        self.tree.headerItem().setToolTip(BASE_COL, "whether the adapter fits the loaded model")
        self.tree.setToolTip("Drop .gguf LoRA files or PEFT folders here")

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.tree, 1)

        bridge.adapters_changed.connect(lambda _: self.set_adapters(bridge.engine.adapters()))
        bridge.adapter_error.connect(self.show_error)
        bridge.adapter_added.connect(self._added)
        bridge.model_loaded.connect(self._model_loaded)
        info = bridge.engine.model_info()
        self._model_name = info.get("name", "")
        self.set_adapters(bridge.engine.adapters())

    # -- actions ---------------------------------------------------------------------
    def add_paths(self, paths: list[str | Path], scale: float = 0.0) -> None:
        models = [str(p) for p in paths if is_model_gguf(p)]
        for p in paths:
            if str(p) in models:
                continue
            self.errors.pop(str(p), None)
            self.bridge.add_adapter(str(p), scale)
        self._rebuild()
        if models:
            self.offer_model(models[0])

    def offer_model(self, path: str) -> None:
        """A whole model was added as an adapter: offer to open it as the model."""
        box = self.model_prompt = QMessageBox(self)
        box.setIcon(QMessageBox.Question)
        box.setWindowTitle("This is a model, not an adapter")
        box.setText(f"{Path(path).name} is a model file, not a LoRA adapter.")
        box.setInformativeText("Open it as the model? The adapters that fit it stay loaded.")
        box.open_btn = box.addButton("Open as model", QMessageBox.AcceptRole)
        box.addButton(QMessageBox.Cancel)
        box.setDefaultButton(box.open_btn)

        def done(_=None) -> None:
            if box.clickedButton() is box.open_btn:
                self.open_model_requested.emit(path)

        box.finished.connect(done)
        box.open()  # window-modal, without a nested event loop

    def _add_files(self) -> None:
        files, _ = QFileDialog.getOpenFileNames(
            self,
            "Add LoRA adapters",
            self._start_dir(),
            "LoRA adapters (*.gguf *.safetensors);;All files (*)",
        )
        self.add_paths(files)

    def _add_folder(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Add a PEFT adapter folder", self._start_dir())
        if d:
            self.add_paths([d])

    def _start_dir(self) -> str:
        recent = self.settings.get("recent_adapters") or []
        return str(Path(recent[0]).parent) if recent else str(Path.home())

    def remove_selected(self) -> None:
        # Read every selected row first: removing an adapter makes the engine announce
        # the change, which rebuilds the tree and deletes the items still to be read.
        rows = [
            (item.data(0, ERROR_ROLE), item.data(0, Qt.UserRole))
            for item in self.tree.selectedItems()
        ]
        for err_path, aid in rows:
            if err_path:
                self.errors.pop(err_path, None)
            elif aid is not None:
                self.bridge.remove_adapter(aid)
        self._rebuild()

    # -- engine events --------------------------------------------------------------------
    def _added(self, aid: int, path: str) -> None:
        self.errors.pop(path, None)
        self.settings.add_recent("recent_adapters", path)

    def _model_loaded(self, ev: ModelLoaded) -> None:
        self._model_name = ev.info.get("name", "")
        self.errors.clear()
        self._rebuild()

    def show_error(self, path: str, message: str) -> None:
        self.errors[path] = message
        self._rebuild()
        self.message.emit(f"Adapter not loaded: {problem_text(message)}")

    def set_adapters(self, adapters: list[dict]) -> None:
        self._adapters = adapters
        self._rebuild()

    def _rebuild(self) -> None:
        self.tree.clear()
        for a in self._adapters:
            alpha = "—" if a.get("alpha") in (None, 0) else f"{a['alpha']:g}"
            targets = compact_targets(a.get("targets") or [])
            item = QTreeWidgetItem(
                [
                    a["name"],
                    str(a.get("rank", "")),
                    alpha,
                    human_bytes(file_size(a.get("path", ""))),
                    a.get("task_name") or "—",
                    "✓ fits base",
                    targets,
                ]
            )
            item.setToolTip(BASE_COL, f"shapes and targets match {self._model_name or 'the model'}")
            item.setToolTip(
                SIZE_COL,
                f"on disk; {human_bytes(a.get('size_bytes', 0))} in memory (as float32)",
            )
            item.setTextAlignment(SIZE_COL, Qt.AlignRight | Qt.AlignVCenter)
            item.setData(0, Qt.UserRole, a["id"])
            item.setToolTip(0, f"{a.get('path', '')}\nformat: {a.get('format', '')}")
            item.setToolTip(TARGETS_COL, ", ".join(a.get("targets") or []))
            if a.get("prompt_prefix"):
                item.setToolTip(4, f"prompt prefix: {a['prompt_prefix']}")
            item.setForeground(BASE_COL, QBrush(QColor(theme.current().ok)))
            self.tree.addTopLevelItem(item)
        for path, msg in self.errors.items():
            reason = reason_text(path, msg)
            item = QTreeWidgetItem([Path(path).name, "", "", "", "", f"✗ {reason}", ""])
            item.setData(0, ERROR_ROLE, path)
            for c in range(len(COLUMNS)):
                item.setForeground(c, QBrush(QColor(theme.current().danger)))
                item.setToolTip(c, f"{path}\n{reason}")
            self.tree.addTopLevelItem(item)

    # -- drag and drop ----------------------------------------------------------------------
    def files_dropped(self, paths: list[str]) -> None:
        self.add_paths(paths)
