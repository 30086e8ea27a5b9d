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

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


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
