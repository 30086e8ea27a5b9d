"""The Mixdesk window: model bar on top, the mixing desk and adapters on the left,
chat / A-B compare / server tabs on the right. It only wires widgets together;
each widget takes the bridge (and settings) and listens to its signals."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QByteArray, QSize, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QGuiApplication, QIcon, QKeySequence
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from core.serve.engine import Engine
from core.serve.events import ModelLoaded
from core.settings import Conversations, Settings
from core.version import version

from .adapters import AdapterPanel, problem_text
from .bridge import EngineBridge
from .chat import ChatPane
from .compare import ComparePane
from .export import MixExporter
from .grid import GridPane
from .mix_history import build_edit_menu
from .mixer import MixerPanel
from .model_bar import ModelBar
from .sampling import SamplingForm
from .server_panel import ServerPanel
from .theme import ThemeController
from .util import RESOURCES, FileDropMixin, is_adapter_path
from .workers import collect_on_gui_thread

TITLE = "Mixdesk — LoRA mixing desk"
PREFERRED_SIZE = QSize(1400, 880)
FRAME_ALLOWANCE = QSize(24, 48)  # window decorations and a panel the screen size includes


def initial_size(available: QSize) -> QSize:
    """The first-start size: the preferred one, shrunk to fit the screen's free area
    (a 1280x800 laptop has ~1280x770 of it) with room for the title bar."""
    return QSize(
        min(PREFERRED_SIZE.width(), available.width() - FRAME_ALLOWANCE.width()),
        min(PREFERRED_SIZE.height(), available.height() - FRAME_ALLOWANCE.height()),
    )


class ErrorBanner(QWidget):
    """A dismissable error line under the model bar: errors are shown, never raised.
    It takes its own room in the layout, pushing the desk and the tabs down, so it
    never covers a control (as a 70 px overlay it hid Zero all, Bypass all, the
    presets and the tab bar). A long text is cut to a few lines, all of it in the
    tooltip. An error goes away with the next success; a note about a file that
    could not be read (``sticky``) stays until closed."""

    MAX_LINES = 3

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.setAttribute(Qt.WA_StyledBackground, True)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        close = QToolButton(text="✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 4, 6, 4)
        lay.addWidget(self.label, 1)
        lay.addWidget(close, 0, Qt.AlignTop)
        self.messages: list[str] = []
        self.sticky = False
        self.hide()

    def show_error(self, text: str, sticky: bool = False) -> None:
        self.messages.append(text)
        lines = text.splitlines()
        shown = "\n".join(lines[: self.MAX_LINES]) + (" …" if len(lines) > self.MAX_LINES else "")
        self.label.setText(shown)
        self.label.setToolTip(text)
        # at most MAX_LINES wrapped lines tall: a long report must not eat the desk
        self.label.setMaximumHeight(self.label.fontMetrics().lineSpacing() * self.MAX_LINES + 2)
        self.sticky = sticky
        self.show()

    def success(self) -> None:
        """The next action worked: an error about an earlier one is stale now."""
        if not self.sticky:
            self.hide()


class MainWindow(FileDropMixin, QMainWindow):
    def __init__(
        self,
        engine: Engine,
        settings: Settings | None = None,
        conversations: Conversations | None = None,
        args: argparse.Namespace | None = None,
    ):
        """``args``: main.py's parsed flags, which the Server tab's server is built
        from as --headless builds its own (None: the defaults)."""
        super().__init__()
        collect_on_gui_thread()  # never a Qt object freed on a worker (ui/workers.py)
        self.setWindowTitle(TITLE)
        icon = RESOURCES / "icons" / "mixdesk.svg"
        if icon.exists():
            self.setWindowIcon(QIcon(str(icon)))
        self.setAcceptDrops(True)
        self.engine = engine
        self.settings = settings or Settings()
        # before the widgets exist: they are polished once, in the right colours
        self.theme = ThemeController(self.settings, self)
        self.bridge = EngineBridge(engine, self)
        self._closing = False

        self.model_bar = ModelBar(self.bridge, self.settings)
        self.mixer = MixerPanel(self.bridge, self.settings)
        self.adapters = AdapterPanel(self.bridge, self.settings)
        self.sampling = SamplingForm(self.settings)
        self.chat = ChatPane(self.bridge, self.settings, self.sampling, conversations)
        self.compare = ComparePane(self.bridge, self.mixer, self.sampling)
        self.grid = GridPane(self.bridge, self.mixer, self.sampling)
        self.server = ServerPanel(self.bridge, self.settings, args)
        self.banner = ErrorBanner()
        self.exporter = MixExporter(self.bridge, self.settings, self)

        left = QSplitter(Qt.Vertical)
        left.addWidget(_padded(self.mixer))
        left.addWidget(_padded(self.adapters))
        left.setStretchFactor(0, 3)
        left.setStretchFactor(1, 2)
        chat_split = QSplitter(Qt.Horizontal)
        chats = _padded(self.chat.sidebar, margin=4)
        chats.setMinimumWidth(130)  # the window must still fit 1024 px
        chat_split.addWidget(chats)
        chat_split.addWidget(_padded(self.chat))
        side = _padded(self.sampling)
        side.setMaximumWidth(300)
        chat_split.addWidget(side)
        chat_split.setStretchFactor(0, 0)
        chat_split.setStretchFactor(1, 1)
        chat_split.setStretchFactor(2, 0)
        chat_split.setCollapsible(1, False)
        # at 1280 px the chat column gets ~380 px; wider sidebars would take it from there
        chat_split.setSizes([140, 600, 190])
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(chat_split, "Chat")
        self.tabs.addTab(_padded(self.compare), "A/B compare")
        self.tabs.addTab(_padded(self.grid), "X/Y grid")
        self.tabs.addTab(_padded(self.server), "Server")
        self.splitter = QSplitter(Qt.Horizontal)
        self.splitter.addWidget(left)
        self.splitter.addWidget(self.tabs)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([560, 840])

        central = QWidget()
        lay = QVBoxLayout(central)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(self.model_bar)
        lay.addWidget(self.banner)  # in the layout: it pushes the desk down, see ErrorBanner
        lay.addWidget(self.splitter, 1)
        self.setCentralWidget(central)
        self._menus()

        for w in (
            self.model_bar,
            self.mixer,
            self.adapters,
            self.chat,
            self.server,
            self.exporter,
            self.grid,
        ):
            w.message.connect(self.status)
        self.exporter.error.connect(self.show_error)
        self.chat.problem.connect(self.show_error)
        self.model_bar.open_requested.connect(self.open_model)
        self.adapters.open_model_requested.connect(self.open_model)
        self.bridge.error.connect(self.show_error)
        self.bridge.model_error.connect(lambda e: self.show_error(f"Model not loaded: {e.error}"))
        self.bridge.adapter_error.connect(
            lambda p, e: self.show_error(f"Adapter not loaded: {problem_text(e)}")
        )
        self.bridge.model_loaded.connect(self._model_loaded)
        self.bridge.adapter_added.connect(lambda *_: self.banner.success())
        self.chat.reply_finished.connect(
            lambda r: (r.get("meta") or {}).get("stop") != "error" and self.banner.success()
        )
        self.server.state_changed.connect(lambda on: on and self.banner.success())
        self.server.message.connect(self.show_error)
        self.theme.changed.connect(self._theme_changed)
        self._restore()
        # typing goes to the chat at start, as in LM Studio, and no focus ring (issue
        # 36) sits on Open model… before the user has pressed a key
        self.chat.input.setFocus()
        self._report_unreadable_files()
        self.bridge.start()

    # -- layout helpers ------------------------------------------------------------------
    def _menus(self) -> None:
        m = self.menuBar().addMenu("&File")
        act = QAction("&Open model…", self, shortcut=QKeySequence.Open)
        act.triggered.connect(self.model_bar.choose_file)
        m.addAction(act)
        act = QAction("&Get a model…", self)
        act.triggered.connect(self.model_bar.get_model)
        m.addAction(act)
        act = QAction("&Add adapter…", self, shortcut=QKeySequence("Ctrl+Shift+O"))
        act.triggered.connect(self.adapters._add_files)
        m.addAction(act)
        act = QAction("&New control vector…", self)
        act.triggered.connect(self.new_control_vector)
        m.addAction(act)
        m.addSeparator()
        m.addMenu(self.exporter.menu)
        m.addSeparator()
        act = QAction("&Quit", self, shortcut=QKeySequence.Quit)
        act.triggered.connect(self.close)
        m.addAction(act)
        build_edit_menu(self, self.mixer)
        v = self.menuBar().addMenu("&View")
        t = v.addMenu("&Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for mode, label in (("system", "&System"), ("light", "&Light"), ("dark", "&Dark")):
            act = QAction(label, self, checkable=True)
            act.setChecked(self.theme.mode == mode)
            act.triggered.connect(lambda _=False, m=mode: self.theme.set_mode(m))
            group.addAction(act)
            t.addAction(act)
            self.theme_actions[mode] = act
        self.unity_action = QAction("&Unity faders (1.0 = as trained)", self, checkable=True)
        self.unity_action.setChecked(self.mixer.unity)
        self.unity_action.setToolTip(
            "Show faders in effective units, scale × α / r, so 1.0 is each adapter as trained"
        )
        self.unity_action.toggled.connect(self.mixer.set_unity)
        v.addAction(self.unity_action)
        h = self.menuBar().addMenu("&Help")
        act = QAction("&About Mixdesk", self)
        act.triggered.connect(
            lambda: QMessageBox.about(
                self,
                "About Mixdesk",
                f"Mixdesk {version()}: a LoRA mixing desk for local LLMs.\n"
                "Mix adapters live, chat, compare, and serve a llama-server compatible API.",
            )
        )
        h.addAction(act)

    def new_control_vector(self):
        """File > New control vector…: the dialog (ui/vector_train.py), not modal, so
        the chat stays usable while it runs."""
        from .vector_train import VectorTrainDialog

        dlg = VectorTrainDialog(self.bridge, self)
        dlg.made.connect(lambda vid, path: self.status(f"Control vector {Path(path).stem} loaded"))
        dlg.show()
        return dlg

    def _theme_changed(self, _theme) -> None:
        """Re-render what draws its own colours from the palette; rebuild the adapter
        rows, whose state colours come from the theme."""
        self.chat.render()
        self.compare._render()
        self.adapters._rebuild()

    def status(self, text: str) -> None:
        self.statusBar().showMessage(text, 8000)

    def show_error(self, text: str, sticky: bool = False) -> None:
        self.banner.show_error(text, sticky)
        self.status(text.splitlines()[0] if text else text)

    def _report_unreadable_files(self) -> None:
        """Files moved aside at start (corrupt settings, presets or chats) are said once."""
        notes = self.settings.problems + self.chat.store.take_problems()
        if notes:
            self.show_error("\n".join(notes), sticky=True)

    # -- model loading ----------------------------------------------------------------------
    def open_model(
        self, path: str | Callable[[], Path], adapters: list[tuple[str, float]] | None = None
    ) -> None:
        """Load a model and then ``adapters``. Without them (a reload from the window),
        the engine keeps the desk's adapters that fit the new model, with their ids
        and faders; those that do not become red rows with the reason, and the red
        rows already there are tried again (they may fit this model)."""
        self.banner.hide()
        if adapters is None:
            adapters = [(p, 0.0) for p in self.adapters.errors]
            n = len(self.engine.adapters())
            if n:
                self.status(
                    f"Opening the model; the {n} adapter(s) on the desk stay loaded, with "
                    "their ids and faders, if they fit it (any that do not will show why)"
                )
        self.bridge.load_model(path, adapters)

    def restore_desk(self) -> list[tuple[str, float]]:
        """The saved desk's adapters to load at start (with their faders and buttons
        put back when they arrive)."""
        return self.mixer.expect(self.settings.get("desk"))

    def _model_loaded(self, ev: ModelLoaded) -> None:
        info = ev.info
        self.banner.success()
        if info.get("path"):
            self.settings.add_recent("recent_models", info["path"])
        self.status(f"Loaded {info.get('name', '')}")

    # -- drag and drop ------------------------------------------------------------------------
    def files_dropped(self, paths: list[str]) -> None:
        adapters = [p for p in paths if is_adapter_path(p)]
        models = [p for p in paths if p not in adapters]
        if adapters:
            self.adapters.add_paths(adapters)
        if models:
            self.open_model(models[0])

    # -- persistence --------------------------------------------------------------------------------
    def _restore(self) -> None:
        geo = self.settings.get("window_geometry")
        screen = self.screen() or QGuiApplication.primaryScreen()
        avail = screen.availableGeometry().size() if screen else PREFERRED_SIZE
        if not (geo and self.restoreGeometry(QByteArray.fromBase64(geo.encode()))):
            self.resize(initial_size(avail))
        elif self.width() > avail.width() or self.height() > avail.height():
            self.resize(self.size().boundedTo(initial_size(avail)))  # saved on a larger screen
        split = self.settings.get("splitter_state")
        if split:
            self.splitter.restoreState(QByteArray.fromBase64(split.encode()))
        tab = self.settings.get("tab")
        if isinstance(tab, int):
            self.tabs.setCurrentIndex(tab)
        if (self.settings.get("server") or {}).get("enabled"):
            QTimer.singleShot(0, lambda: self.server.toggle.setChecked(True))

    def save_state(self) -> None:
        self.settings.set("window_geometry", bytes(self.saveGeometry().toBase64()).decode())
        self.settings.set("splitter_state", bytes(self.splitter.saveState().toBase64()).decode())
        self.settings.set("tab", self.tabs.currentIndex())

    def closeEvent(self, event) -> None:
        self.save_state()
        if self.server.runner is not None and _loop_running():
            # Stop the server on the loop first (it answers in-flight requests), then close.
            event.ignore()
            if not self._closing:
                self._closing = True
                asyncio.ensure_future(self._stop_server_then_close())
            return
        self.shutdown()
        super().closeEvent(event)

    async def _stop_server_then_close(self) -> None:
        try:
            await self.server.stop(remember=False)
        finally:
            self.close()

    def shutdown(self) -> None:
        if self.server.runner is not None:  # no loop to stop it on: drop it
            self.server.runner = self.server.site = None
        self.chat.stop()
        self.compare.stop()
        self.model_bar.stop_fetch()
        self.grid.stop()
        self.exporter.shutdown()
        self.bridge.shutdown()


def _loop_running() -> bool:
    try:
        return asyncio.get_event_loop().is_running()
    except RuntimeError:
        return False


def _padded(w: QWidget, margin: int = 8) -> QWidget:
    host = QWidget()
    lay = QVBoxLayout(host)
    lay.setContentsMargins(margin, margin, margin, margin)
    lay.addWidget(w)
    return host
