"""File → Export mix: write the desk's current mix as a LoRA GGUF, a merged model
GGUF or a PEFT folder (core.export does the work).

The export runs on an :class:`ExportWorker` (a :class:`ui.workers.Worker`); core's
``progress(frac, msg)`` callback reaches a QProgressDialog through a queued signal.
Core's exports take no cancel flag, so Cancel is honoured in that callback
(``Worker.check``): core then removes its temporary file and nothing is left at
the target. What is
exported is the engine's global mix at the moment the export starts
(``engine.get_mix()``: faders with mute, solo and bypass applied).
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMenu, QProgressDialog, QWidget

from core.errors import UserError
from core.lora.export import (
    CANNOT_FOLD,
    export_control_vector,
    export_lora,
    export_merged,
    export_peft,
    vector_path,
)
from core.settings import Settings

from .bridge import EngineBridge
from .util import human_bytes
from .workers import Worker

log = logging.getLogger(__name__)

KINDS = ("lora", "merged", "peft")
LABELS = {
    "lora": "As LoRA adapter (.gguf)…",
    "merged": "As merged model (.gguf)…",
    "peft": "As PEFT folder…",
}
WHAT = {"lora": "LoRA adapter", "merged": "merged model", "peft": "PEFT folder"}
OUTTYPES = {
    "f16": "f16 — half the size of f32, nearly exact (default)",
    "f32": "f32 — exact, largest",
    "q8_0": "q8_0 — smallest, slight quality loss",
}
EMPTY_MIX = (
    "Nothing to export: the mix is empty (every adapter is at 0, muted, "
    "left out by solo, or bypassed). Raise a fader first."
)


class ExportWorker(Worker):
    """One export on a worker thread. Exactly one of ``returned(ExportResult)``,
    ``errored(exception)`` or ``aborted()`` is emitted, then ``finished()``;
    ``progressed(frac, msg)`` on the way."""

    progressed = Signal(float, str)

    def __init__(self, engine, kind: str, adapters: list, out: Path, outtype: str = "f16"):
        if kind not in KINDS:
            raise ValueError(f"unknown export kind {kind!r}")
        super().__init__(self._export, name="mixdesk-export")
        self.engine, self.kind, self.adapters = engine, kind, adapters
        # the global mix's merge method now, with its scales: a merged mix exports as
        # its merged adapter (#21)
        self.merge = engine.get_mix().merge
        self.out, self.outtype = Path(out), outtype
        self.what = WHAT[kind] + (f" ({outtype})" if kind == "merged" else "")
        # the desk's control vectors now: written beside the export as one vector file
        self.vectors, self.layers = engine.steering()
        self.label = f"Exporting the mix as a {self.what}…"  # the dialog's first line(s)

    def _progress(self, frac: float, msg: str) -> None:  # worker thread, called by core
        # core's exports take no cancel event: their progress callback is where the
        # abort is honoured (core then removes its temporary file). At 1.0 the file is
        # already in place: a late Cancel does not undo a finished export.
        if frac < 1.0:
            self.check()
        self.progressed.emit(frac, msg)

    def _export(self):
        res = self._export_mix()
        if self.vectors:
            self.check()
            cfg = self.engine.config
            res.vectors = export_control_vector(
                cfg, self.vectors, self.layers, vector_path(self.out)
            ).path
        return res

    def _export_mix(self):
        self.check()
        if self.kind == "lora":
            return export_lora(
                self.engine, self.adapters, self.out, progress=self._progress, merge=self.merge
            )
        if self.kind == "merged":
            return export_merged(
                self.engine,
                self.adapters,
                self.out,
                outtype=self.outtype,
                progress=self._progress,
                merge=self.merge,
            )
        return export_peft(
            self.engine, self.adapters, self.out, progress=self._progress, merge=self.merge
        )


class MixExporter(QObject):
    """The "Export mix" submenu, its dialogs and the running export (one at a time).
    Outcomes go out as ``message`` (status line) and ``error`` (the window's inline
    error banner)."""

    message = Signal(str)
    error = Signal(str)
    finished = Signal(object)  # ExportResult, or None if cancelled/failed/refused

    def __init__(self, bridge: EngineBridge, settings: Settings, parent: QWidget):
        super().__init__(parent)
        self.bridge, self.engine, self.settings = bridge, bridge.engine, settings
        self.window = parent
        self.worker: ExportWorker | None = None
        self.dialog: QProgressDialog | None = None
        self.menu = QMenu("&Export mix", parent)
        self.menu.setToolTipsVisible(True)
        self.actions: dict[str, QAction] = {}
        for kind in KINDS:
            act = self.menu.addAction(LABELS[kind])
            act.triggered.connect(lambda _=False, k=kind: self.export(k))
            self.actions[kind] = act
        self.actions["lora"].setToolTip("One llama.cpp LoRA GGUF that means this mix at scale 1")
        self.actions["merged"].setToolTip(
            "The base model with this mix baked in (f16, f32 or q8_0)"
        )
        self.actions["peft"].setToolTip("A Hugging Face PEFT LoRA folder (safetensors + config)")

    # -- what is exported ----------------------------------------------------------
    def current_mix(self) -> list:
        """(Adapter, scale) for every adapter the engine's global mix plays. Adapter
        objects, not ids: an adapter removed during the export stays exportable."""
        out = []
        for aid, scale in sorted(self.engine.get_mix().items()):
            if scale != 0.0:
                try:
                    out.append((self.engine.adapter(aid), scale))
                except UserError:  # removed since get_mix (e.g. over HTTP)
                    continue
        return out

    # -- the action: check, ask, start -------------------------------------------------
    def export(self, kind: str) -> ExportWorker | None:
        if self.worker is not None:
            self.message.emit("An export is already running")
            return None
        if self.engine.config is None:
            return self._refuse("Nothing to export: no model is loaded.")
        if not self.current_mix():
            return self._refuse(EMPTY_MIX)
        outtype = "f16"
        if kind == "merged":
            labels = list(OUTTYPES.values())
            choice, ok = QInputDialog.getItem(
                self.window,
                "Export merged model",
                "Tensor type of the merged model:",
                labels,
                0,
                False,
            )
            if not ok:
                return None
            outtype = list(OUTTYPES)[labels.index(choice)] if choice in labels else "f16"
        path = self._ask_path(kind, outtype)
        if not path:
            return None
        return self.start(kind, path, outtype)

    def _ask_path(self, kind: str, outtype: str) -> str:
        stem = Path(self.engine.path).stem if self.engine.path else "model"
        name = {
            "lora": f"{stem}-mix-lora.gguf",
            "merged": f"{stem}-mix-{outtype}.gguf",
            "peft": f"{stem}-mix-peft",
        }[kind]
        start = str(Path(self.settings.get("export_dir") or Path.home()) / name)
        if kind == "peft":
            path, _ = QFileDialog.getSaveFileName(
                self.window,
                "Export the mix as a PEFT folder (name of the folder to write)",
                start,
                "PEFT folder (*)",
            )
        else:
            path, _ = QFileDialog.getSaveFileName(
                self.window,
                f"Export the mix as a {WHAT[kind]}",
                start,
                "GGUF files (*.gguf);;All files (*)",
            )
        return path

    def start(self, kind: str, path: str | Path, outtype: str = "f16") -> ExportWorker | None:
        """Export the current mix to ``path`` on a worker thread, with a progress dialog."""
        if self.worker is not None:
            self.message.emit("An export is already running")
            return None
        adapters = self.current_mix()
        if not adapters:
            return self._refuse(EMPTY_MIX)
        out = Path(path)
        self.settings.set("export_dir", str(out.parent))
        worker = self.worker = ExportWorker(self.engine, kind, adapters, out, outtype)
        what = worker.what

        label = f"Exporting the mix as a {what}…"
        if worker.vectors:  # the dialog says where the vectors go, and what cannot be
            label += f"\nIts control vectors go beside it, as {vector_path(out).name}"
            if kind == "merged":
                label += f"\n({CANNOT_FOLD})"
        worker.label = label
        dlg = self.dialog = QProgressDialog(label, "Cancel", 0, 1000, self.window)
        dlg.setWindowTitle("Export mix")
        dlg.setWindowModality(Qt.NonModal)  # the desk and chat keep working meanwhile
        dlg.setAutoClose(False)
        dlg.setAutoReset(False)
        dlg.setMinimumDuration(0)
        dlg.setMinimumWidth(420)
        dlg.canceled.connect(self.cancel)
        dlg.setValue(0)
        dlg.show()

        q = Qt.QueuedConnection  # emitted on the worker thread
        worker.progressed.connect(self._progressed, q)
        worker.returned.connect(self._succeeded, q)
        worker.errored.connect(self._failed, q)
        worker.aborted.connect(self._cancelled, q)
        worker.finished.connect(self._thread_done, q)
        for act in self.actions.values():
            act.setEnabled(False)
        self.message.emit(f"Exporting the mix as a {what} to {out}…")
        worker.start()
        return worker

    def cancel(self) -> None:
        if self.worker is not None and not self.worker.abort_requested:
            self.worker.abort()
            self.message.emit("Cancelling the export…")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Window closing: cancel a running export and wait for its thread."""
        if self.worker is not None:
            self.worker.abort()
            self.worker.wait(timeout_s)

    # -- outcomes (GUI thread) --------------------------------------------------------------
    def _refuse(self, text: str) -> None:
        self.error.emit(text)
        self.finished.emit(None)
        return None

    def _progressed(self, frac: float, msg: str) -> None:
        if self.dialog is not None and not self.dialog.wasCanceled():
            self.dialog.setValue(int(round(frac * 1000)))
            if msg:
                self.dialog.setLabelText(
                    f"{self.worker.label}\n{msg}" if self.worker is not None else msg
                )

    def _succeeded(self, res) -> None:
        self._close_dialog()
        text = f"Exported the mix to {res.path} ({human_bytes(res.nbytes)})"
        if res.vectors is not None:
            text += f"; its control vectors to {res.vectors.name} (load with --control-vector)"
        self.message.emit(text)
        self.finished.emit(res)

    def _failed(self, e: BaseException) -> None:
        self._close_dialog()
        # a user's problem (ExportError, AdapterError) in one line; a bug names its type
        err = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        self.error.emit(f"Export failed: {err}")
        self.finished.emit(None)

    def _cancelled(self) -> None:
        self._close_dialog()
        self.message.emit("Export cancelled; nothing was written")
        self.finished.emit(None)

    def _close_dialog(self) -> None:
        if self.dialog is not None:
            self.dialog.canceled.disconnect(self.cancel)
            self.dialog.close()
            self.dialog.deleteLater()
            self.dialog = None

    def _thread_done(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.deleteLater()
        for act in self.actions.values():
            act.setEnabled(True)
