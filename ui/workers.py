"""The one way the window runs slow work off the GUI thread (like superqt's
``thread_worker``): model load, adapter load, export, chat and compare submissions.

A :class:`Worker` runs a function, or a generator, on a daemon thread and reports
through Qt signals, which Qt queues to the GUI thread (the worker object lives
there):

* ``started()``, then for a generator ``yielded(value)`` per value;
* exactly one of ``returned(value)``, ``errored(exception)`` or ``aborted()``;
* then ``finished()``.

``abort()`` asks the work to stop. A generator is stopped at its next ``yield``
(it is closed, so its ``finally`` blocks run). A function that takes an ``abort``
keyword gets the worker's :class:`threading.Event` and stops where it looks at it:
core's long calls take it as their ``cancel`` event. Work that can only be stopped
from a callback (core.export's progress) calls :meth:`Worker.check`, which raises
:class:`Aborted` once abort was asked; the worker then emits ``aborted``.

Connect the signals first, then call :meth:`start` (or use :func:`start_worker`).
"""

from __future__ import annotations

import gc
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QCoreApplication, QObject, QTimer, Signal

log = logging.getLogger(__name__)


class GuiThreadGC(QObject):
    """Python's cyclic garbage collected on the GUI thread only.

    Python collects cycles on whichever thread happens to allocate past the threshold:
    with the window open that is often a worker (a model load builds a 128k-entry merge
    table). A cycle holding a Qt object (a widget, a lambda connected to a signal) is
    then destroyed off the GUI thread, which crashed the process inside the tokenizer's
    load (the full test suite, twice, at the same window test). So automatic collection
    is off while the window runs, and this timer on the GUI thread collects the
    generation whose count passed its threshold, as Python itself would have.
    """

    INTERVAL_MS = 500

    def __init__(self, app: QCoreApplication):
        super().__init__(app)
        self.threshold = gc.get_threshold()
        gc.disable()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.check)
        self.timer.start(self.INTERVAL_MS)
        app.aboutToQuit.connect(self.stop)

    def check(self) -> None:
        counts = gc.get_count()
        passed = [g for g in range(3) if counts[g] > self.threshold[g]]
        if passed:
            gc.collect(passed[-1])

    def stop(self) -> None:
        self.timer.stop()
        gc.enable()


def collect_on_gui_thread() -> GuiThreadGC | None:
    """Install GuiThreadGC on the running QApplication, once (the window calls this)."""
    app = QCoreApplication.instance()
    if app is None:
        return None
    found = app.findChild(GuiThreadGC)
    return found if found is not None else GuiThreadGC(app)


class Aborted(Exception):
    """Raised by :meth:`Worker.check` inside the work once ``abort()`` was called."""


class Worker(QObject):
    started = Signal()
    yielded = Signal(object)
    returned = Signal(object)
    errored = Signal(object)  # the exception; already logged when it is not a UserError
    aborted = Signal()
    finished = Signal()

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "", **kwargs: Any):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.name = name or f"mixdesk-{getattr(fn, '__name__', 'worker')}"
        self.abort_event = threading.Event()
        if _takes_abort(fn):
            self.kwargs.setdefault("abort", self.abort_event)
        self._thread: threading.Thread | None = None
        self.done = threading.Event()

    # -- control (any thread) ---------------------------------------------------------
    def start(self) -> Worker:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def abort(self) -> None:
        self.abort_event.set()

    @property
    def abort_requested(self) -> bool:
        return self.abort_event.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self.done.is_set()

    def check(self) -> None:
        """Inside the work: raise Aborted if abort() was called."""
        if self.abort_event.is_set():
            raise Aborted()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the work is over (True) or ``timeout_s`` passed (False)."""
        return self.done.wait(timeout_s) if self._thread is not None else True

    # -- the worker thread -----------------------------------------------------------------
    def _run(self) -> None:
        self.started.emit()
        try:
            result = self.fn(*self.args, **self.kwargs)
            if inspect.isgenerator(result):
                result = self._drain(result)
        except Aborted:
            self.aborted.emit()
        except BaseException as e:
            if self.abort_event.is_set() and _is_cancel(e):
                self.aborted.emit()
            else:
                if not _is_user_error(e):
                    log.error("%s failed", self.name, exc_info=e)
                self.errored.emit(e)
        else:
            if self.abort_event.is_set() and result is _ABORTED:
                self.aborted.emit()
            else:
                self.returned.emit(result)
        finally:
            self.done.set()
            self.finished.emit()

    def _drain(self, gen) -> Any:
        try:
            while True:
                if self.abort_event.is_set():
                    gen.close()
                    return _ABORTED
                self.yielded.emit(next(gen))
        except StopIteration as stop:
            return stop.value


_ABORTED = object()


def start_worker(
    fn: Callable[..., Any],
    *args: Any,
    connect: dict[str, Callable] | None = None,
    **kwargs: Any,
) -> Worker:
    """Make a Worker, connect ``connect`` ({signal name: slot}), start it."""
    worker = Worker(fn, *args, **kwargs)
    for signal, slot in (connect or {}).items():
        getattr(worker, signal).connect(slot)
    return worker.start()


def _takes_abort(fn: Callable) -> bool:
    try:
        return "abort" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _is_user_error(e: BaseException) -> bool:
    from core.errors import UserError

    return isinstance(e, UserError)


def _is_cancel(e: BaseException) -> bool:
    """core's own "cancelled" exceptions, raised because the abort event was passed in."""
    from core.catalog import FetchCancelled
    from core.model.weights import LoadCancelled

    return isinstance(e, (LoadCancelled, FetchCancelled))
