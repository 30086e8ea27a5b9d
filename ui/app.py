"""GUI entry point: ``run_gui(args) -> int`` (called by main.py).

Creates the QApplication, the qasync event loop (so the HTTP server shares the
GUI thread's loop and the GUI's engine), the one Engine, and the window; then
loads the model (the default SmolLM2 when none is given, plus the demo
adapters at scale 0) in the background with progress.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import traceback
from pathlib import Path

from core.options import DEFAULT_HOST as CLI_DEFAULT_HOST
from core.options import DEFAULT_PORT as CLI_DEFAULT_PORT

from .util import RESOURCES

log = logging.getLogger(__name__)
# The engine thread holds the GIL between numpy calls, so the GUI thread waits for it
# each time it re-enters Python. Measured with SmolLM2 generating on 2 busy cores and
# the GUI thread waking every 4 ms to run a slot's worth of Python: with Python's
# default 5 ms interval it waited p95 2.5 ms, max 17.8 ms; with 1 ms, p95 1.5 ms,
# max 7.1 ms (median 0.34 ms both). Set once, for the process, when the window starts.
GIL_SWITCH_S = 0.001


def demo_adapters() -> list[tuple[str, float]]:
    """The bundled demo adapters, at scale 0: the default model's first desk."""
    return [(str(p), 0.0) for p in sorted((RESOURCES / "adapters").glob("*.gguf"))]


def load_stylesheet(dark: bool = False) -> str:
    """The stylesheet in the light (or dark) theme's colours; the window's
    ThemeController applies the one the View menu chose."""
    from .theme import DARK, LIGHT, stylesheet

    return stylesheet(DARK if dark else LIGHT)


def app_icon():
    from PySide6.QtGui import QIcon

    icon = QIcon()
    d = RESOURCES / "icons"
    for size in (16, 32, 48, 128, 256):
        p = d / f"mixdesk-{size}.png"
        if p.exists():
            icon.addFile(str(p))
    if icon.isNull() and (d / "mixdesk.svg").exists():
        icon = QIcon(str(d / "mixdesk.svg"))
    return icon


def build_window(args: argparse.Namespace, engine):
    """The window over ``engine``, its Server tab set from the flags (no model load)."""
    from core.settings import Settings

    from .main_window import MainWindow

    win = MainWindow(engine, Settings(), args=args)
    # Flags override the saved server settings only when they differ from main.py's
    # defaults (argparse cannot tell "--port 8080" from no flag at all).
    host, port, keys = (
        getattr(args, "host", None),
        getattr(args, "port", None),
        getattr(args, "api_key", None),
    )
    if host and host != CLI_DEFAULT_HOST:
        win.server.host.setText(host)
    if port and int(port) != CLI_DEFAULT_PORT:
        win.server.port.setValue(int(port))
    if keys:
        win.server.api_key.setText(keys[0])
    if getattr(args, "allow_runtime_lora", False):
        win.server.allow_lora.setChecked(True)
    win.server._save()
    return win


def create_window(args: argparse.Namespace):
    """The window with its engine, model load started (tests and run_gui share this)."""
    from core.default_model import ensure_default_model
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from core.startup import startup_adapters

    win = build_window(args, Engine(EngineOptions.from_args(args)))  # as core/startup.py
    model = getattr(args, "model", None)
    target = Path(model) if model else (lambda: ensure_default_model(log=log.info))
    # adapters named on the command line win (as headless); else the desk as it was
    # left; else, for the default model, the demo adapters
    adapters = startup_adapters(args) or win.restore_desk() or ([] if model else demo_adapters())
    win.open_model(target, adapters)
    return win


def run_gui(args: argparse.Namespace) -> int:
    """Raises UserError (main.py prints it as one line), before any Qt object exists,
    when no window can open here."""
    from core.errors import UserError

    from .display import display_problem

    problem = display_problem()
    if problem:
        raise UserError(problem)
    import qasync
    from PySide6.QtWidgets import QApplication

    sys.setswitchinterval(GIL_SWITCH_S)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Mixdesk")
    app.setOrganizationName("Mixdesk")
    app.setDesktopFileName("mixdesk")
    app.setWindowIcon(app_icon())
    app.setStyle("Fusion")
    app.setStyleSheet(load_stylesheet())

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    win = create_window(args)

    def excepthook(etype, value, tb):  # a bug in a slot shows a message, not a crash
        log.error("unhandled error:\n%s", "".join(traceback.format_exception(etype, value, tb)))
        try:
            win.show_error(f"Internal error: {value}")
        except Exception:
            pass

    sys.excepthook = excepthook

    win.show()
    app.aboutToQuit.connect(win.shutdown)
    _quit_on_signals(app)
    with loop:
        code = loop.run_forever()
    teardown(app, win)
    return int(code or 0)


def _quit_on_signals(app) -> None:
    """Ctrl+C / SIGTERM close the window cleanly (saving state) instead of killing it.
    Python only runs signal handlers between bytecodes, so a timer wakes it up."""
    import signal

    from PySide6.QtCore import QTimer

    def quit_(*_):  # closing the last window quits (after the server stops)
        for w in app.topLevelWidgets():
            if w.isVisible():
                w.close()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, quit_)
        except (ValueError, OSError):  # not the main thread
            pass
    timer = QTimer(app)
    timer.timeout.connect(lambda: None)
    timer.start(250)


def teardown(app, win) -> None:
    """Stop the engine thread and free Qt objects while the interpreter is whole.
    Left to interpreter finalization, shiboken's objects can be collected in an order
    that aborts the process (seen with PySide6 6.12), after everything was saved."""
    import gc

    from PySide6.QtCore import QEvent

    win.shutdown()
    win.deleteLater()
    app.processEvents()
    app.sendPostedEvents(None, QEvent.DeferredDelete)
    del win
    gc.collect()
    gc.freeze()  # nothing left for the final collection to reorder
