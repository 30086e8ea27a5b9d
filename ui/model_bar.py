"""Model bar: open a GGUF (button, Ctrl+O, recent list, drag and drop), a cancellable
progress bar while it loads, and the loaded model's facts."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QMenu,
    QProgressBar,
    QPushButton,
    QToolButton,
    QWidget,
)

from core.serve.events import ModelError, ModelLoading
from core.settings import Settings

from .bridge import EngineBridge
from .get_model import GetModelDialog
from .util import ElidedLabel, FactsLabel, FileDropMixin, human_bytes, human_count


def _kv_storage(info: dict) -> str:
    """How the KV cache stores keys and values, when not the default float32."""
    k, v = info.get("cache_type_k", "f32"), info.get("cache_type_v", "f32")
    if (k, v) == ("f32", "f32"):
        return ""
    return f" (keys {k}, values {v})" if k != v else f" ({k})"


class ModelBar(FileDropMixin, QWidget):
    message = Signal(str)
    open_requested = Signal(str)  # a path chosen by the user (main window loads it)

    def __init__(self, bridge: EngineBridge, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("modelBar")
        self.bridge = bridge
        self.settings = settings
        self.setAcceptDrops(True)

        self.open_btn = QPushButton("Open model…")
        self.open_btn.setObjectName("primaryButton")
        self.open_btn.setToolTip("Open a GGUF model (Ctrl+O)")
        self.open_btn.clicked.connect(self.choose_file)
        self.recent_btn = QToolButton(text="Recent")
        self.recent_btn.setPopupMode(QToolButton.InstantPopup)
        self.recent_menu = QMenu(self)
        self.recent_btn.setMenu(self.recent_menu)
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        # the built-in catalogue (ui/get_model.py): fetch a real model and open it
        self.get_btn = QPushButton("Get a model…")
        self.get_btn.setToolTip("Download a model from Mixdesk's small catalogue and open it")
        self.get_btn.clicked.connect(self.get_model)
        self.get_dialog: GetModelDialog | None = None

        self.name = ElidedLabel("No model")
        self.name.setObjectName("modelName")
        self.name.setMaximumWidth(360)
        # The facts line yields its width to the progress bar and Cancel while a model
        # loads (elided, full text in the tooltip) instead of widening the window.
        self.info = FactsLabel()
        self.info.setObjectName("modelInfo")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setFixedWidth(220)
        self.progress.setTextVisible(True)
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.clicked.connect(bridge.cancel_load)
        self.progress.hide()
        self.cancel_btn.hide()

        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        lay.addWidget(self.open_btn)
        lay.addWidget(self.recent_btn)
        lay.addWidget(self.get_btn)
        lay.addSpacing(12)
        lay.addWidget(self.name)
        lay.addWidget(self.info, 1)
        lay.addWidget(self.progress)
        lay.addWidget(self.cancel_btn)

        bridge.model_loading.connect(self._loading)
        bridge.model_loaded.connect(lambda ev: self.show_info(ev.info))
        bridge.model_error.connect(self._failed)
        bridge.model_cancelled.connect(self._cancelled)
        if bridge.engine.config is not None:
            self.show_info(bridge.engine.model_info())

    def choose_file(self) -> None:
        recent = self.settings.recent_models()
        start = str(Path(recent[0]).parent) if recent else str(Path.home())
        path, _ = QFileDialog.getOpenFileName(
            self, "Open a GGUF model", start, "GGUF models (*.gguf);;All files (*)"
        )
        if path:
            self.open_requested.emit(path)

    def get_model(self) -> GetModelDialog:
        """Show the catalogue; a model it fetches (or finds already fetched) opens the
        way a file chosen with Open model… does. One dialog, reused: a fetch in
        progress keeps its progress when the dialog is shown again."""
        if self.get_dialog is None:
            engine = self.bridge.engine
            self.get_dialog = GetModelDialog(engine.requested_ctx, self, kv_types=engine.kv_types)
            self.get_dialog.open_requested.connect(self.open_requested)
        self.get_dialog.show()
        self.get_dialog.raise_()
        self.get_dialog.activateWindow()
        return self.get_dialog

    def stop_fetch(self, timeout_s: float = 15.0) -> None:
        """At quit: cancel a catalogue download and let it remove its files (and stop
        pip) before the process ends."""
        worker = self.get_dialog.worker if self.get_dialog is not None else None
        if worker is not None:
            worker.abort()
            worker.wait(timeout_s)

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        recent = self.settings.recent_models()
        if not recent:
            self.recent_menu.addAction("(no recent models)").setEnabled(False)
        for p in recent:
            act = self.recent_menu.addAction(Path(p).name)
            act.setToolTip(p)
            act.triggered.connect(lambda _=False, p=p: self.open_requested.emit(p))

    def _loading(self, ev: ModelLoading) -> None:
        self.progress.show()
        self.cancel_btn.show()
        self.progress.setValue(int(ev.progress * 1000))
        self.progress.setFormat(f"{ev.message or 'loading'} %p%")

    def _failed(self, ev: ModelError) -> None:
        self.progress.hide()
        self.cancel_btn.hide()
        self.message.emit(f"Model not loaded: {ev.error}")

    def _cancelled(self, _: ModelError) -> None:
        self.progress.hide()
        self.cancel_btn.hide()
        name = self.bridge.engine.model_info().get("name")
        self.message.emit(f"Load cancelled; {name} stays loaded" if name else "Load cancelled")

    def show_info(self, info: dict) -> None:
        self.progress.hide()
        self.cancel_btn.hide()
        if not info:
            return
        self.name.setText(info.get("name") or Path(info.get("path", "")).name)
        self.name.setToolTip(info.get("path", ""))
        parts = [
            info.get("arch", "?"),
            f"{human_count(info.get('n_params', 0))} params",
            str(info.get("quant", "?")),
            f"ctx {info.get('n_ctx', 0)}/{info.get('n_ctx_train', 0)}",
            f"{human_bytes(info.get('ram_bytes', 0))} RAM",
            f"loaded in {info.get('load_ms', 0) / 1000:.2f} s",
        ]
        # at 1024 px not every fact fits: the architecture, then the parameters and the
        # context go first; the quant, RAM and load time stay
        self.info.set_parts(parts, drop_order=[0, 1, 3])
        storage = "float32"
        if info.get("weights") == "quantized":
            where = "mapped from the file" if info.get("mapped") else "read into memory"
            storage = f"quantized blocks {where}"
        if info.get("activations") == "q8":
            storage += ", 8-bit activations"
        self.info.setToolTip(
            f"{self.info.full_text}\nRAM (as Get a model counts it): weights ({storage}) "
            f"{human_bytes(info.get('memory_bytes', 0))} + KV cache of one sequence at "
            f"{info.get('n_ctx', 0)} tokens {human_bytes(info.get('kv_bytes', 0))}"
            f"{_kv_storage(info)}"
        )

    def files_dropped(self, paths: list[str]) -> None:
        self.open_requested.emit(paths[0])
