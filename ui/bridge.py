"""The one bridge between the engine (plain threads, no Qt) and the GUI thread.

* :class:`EngineThread` is the QThread that runs ``engine.run_loop()``.
* :class:`EngineBridge` subscribes to engine events and re-emits them as Qt
  signals; signals emitted from another thread are queued to the GUI thread.
  It also runs slow calls (model load, adapter load) on worker threads and
  reports their outcome as signals, so widgets never block and never see an
  exception: errors arrive as ``error`` signals.
* :class:`Generation` wraps one submitted request; its ``token`` and
  ``finished`` signals arrive on the GUI thread.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Mapping

from PySide6.QtCore import QObject, QThread, Signal

from core.engine import Engine
from core.sampling import SamplingParams
from core.scheduler import DoneEvent

log = logging.getLogger(__name__)


class EngineThread(QThread):
    """Runs the scheduler loop. A model (re)load replaces the engine's scheduler and
    stops the old one; the thread then picks up the new one."""

    def __init__(self, engine: Engine, parent: QObject | None = None):
        super().__init__(parent)
        self.setObjectName("mixdesk-engine")
        self.engine = engine
        self._quit = threading.Event()

    def run(self) -> None:
        ran = None
        while not self._quit.is_set():
            sched = self.engine.scheduler
            if sched is None or sched is ran:     # no model yet, or a reload in progress
                self._quit.wait(0.02)
                continue
            ran = sched
            try:
                self.engine.run_loop()
            except Exception:                      # never let the engine thread die silently
                log.exception("engine loop failed")
                self._quit.wait(0.2)
                ran = None

    def shutdown(self, timeout_ms: int = 5000) -> None:
        self._quit.set()
        self.engine.stop()
        self.wait(timeout_ms)


class Generation(QObject):
    """One request in flight. ``token(text)`` per released piece, then ``finished(done)``."""

    token = Signal(str)
    finished = Signal(object)          # core.scheduler.DoneEvent

    def __init__(self, tag: Any = None, parent: QObject | None = None):
        super().__init__(parent)
        self.tag = tag
        self.request = None
        self.done: DoneEvent | None = None
        self.text = ""
        self.token.connect(self._append)
        self.finished.connect(self._store)

    def _on_event(self, ev) -> None:       # scheduler thread
        if isinstance(ev, DoneEvent):
            self.finished.emit(ev)
        elif ev.text:
            self.token.emit(ev.text)

    def _append(self, text: str) -> None:
        self.text += text

    def _store(self, done: DoneEvent) -> None:
        self.done = done

    @property
    def running(self) -> bool:
        return self.request is not None and self.done is None

    def cancel(self) -> None:
        if self.request is not None:
            self.request.cancel()


class EngineBridge(QObject):
    model_loading = Signal(float, str)
    model_loaded = Signal(object)
    model_error = Signal(str)
    adapters_changed = Signal(object)
    mix_changed = Signal(object, str)          # {id: scale}, source
    request_started = Signal(object)
    adapter_added = Signal(int, str)         # id, path
    adapter_error = Signal(str, str)         # path, message
    error = Signal(str)                      # anything else worth a message

    def __init__(self, engine: Engine, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        self.thread = EngineThread(engine)
        self._cancel_load: threading.Event | None = None
        self._unsubscribe = engine.subscribe(self._on_engine_event)

    # -- engine events (any thread) -> signals -------------------------------------
    def _on_engine_event(self, name: str, payload: dict) -> None:
        if name == "model_loading":
            self.model_loading.emit(float(payload.get("progress", 0.0)), str(payload.get("message", "")))
        elif name == "model_loaded":
            self.model_loaded.emit(dict(payload.get("info") or {}))
        elif name == "model_error":
            self.model_error.emit(str(payload.get("error", "model load failed")))
        elif name == "adapters_changed":
            self.adapters_changed.emit(list(payload.get("adapters") or []))
        elif name == "mix_changed":
            self.mix_changed.emit(dict(payload.get("mix") or {}), str(payload.get("source", "")))
        elif name == "request_started":
            self.request_started.emit(dict(payload))

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if not self.thread.isRunning():
            self.thread.start()

    def shutdown(self) -> None:
        self.cancel_load()
        self._unsubscribe()
        self.thread.shutdown()

    # -- slow work on worker threads ------------------------------------------------------
    @property
    def loading(self) -> bool:
        return self._cancel_load is not None

    def load_model(self, path, adapters: list[tuple[str, float]] = ()) -> None:
        """Load a model off the GUI thread, then the given adapters. Progress, success
        and failure arrive through the model_* and adapter_* signals."""
        if self._cancel_load is not None:
            self._cancel_load.set()
        cancel = self._cancel_load = threading.Event()

        def work() -> None:
            try:
                target = path
                if callable(path):      # e.g. ensure_default_model: may download once
                    self.model_loading.emit(0.0, "fetching the default model")
                    try:
                        target = path()
                    except Exception as e:
                        self.model_error.emit(f"could not get the default model: {e}")
                        return
                try:
                    self.engine.load_model(target, cancel=cancel)
                except BaseException as e:   # the engine already sent model_error
                    log.info("model load failed%s: %s", " (cancelled)" if cancel.is_set() else "", e)
                    return
            finally:
                if self._cancel_load is cancel:
                    self._cancel_load = None
            for apath, scale in adapters:
                self._add_adapter_now(apath, scale)

        threading.Thread(target=work, name="mixdesk-load", daemon=True).start()

    def cancel_load(self) -> None:
        if self._cancel_load is not None:
            self._cancel_load.set()

    def add_adapter(self, path: str | Path, scale: float = 0.0) -> None:
        threading.Thread(target=self._add_adapter_now, args=(path, scale),
                         name="mixdesk-adapter", daemon=True).start()

    def _add_adapter_now(self, path, scale: float) -> None:
        try:
            aid = self.engine.add_adapter(path, scale=scale)
        except Exception as e:
            self.adapter_error.emit(str(path), str(e))
        else:
            self.adapter_added.emit(aid, str(path))

    def remove_adapter(self, aid: int) -> None:
        try:
            self.engine.remove_adapter(aid)
        except Exception as e:
            self.error.emit(str(e))

    def set_mix(self, mix: Mapping[int, float]) -> None:
        try:
            self.engine.set_mix(dict(mix), source="gui", replace=True)
        except Exception as e:
            self.error.emit(f"could not apply the mix: {e}")

    # -- generation --------------------------------------------------------------------------
    def chat(self, messages: list[dict], params: SamplingParams,
             mix: Mapping[int, float] | None = None, tag: Any = None) -> Generation | None:
        """Submit a chat request; None (and an ``error`` signal) if the engine refuses."""
        gen = Generation(tag)          # owned by the caller, not parented: no C++ early delete
        try:
            prompt = self.engine.chat_prompt(messages)
            gen.request = self.engine.submit(prompt, params, gen._on_event, mix=mix, source="gui")
        except Exception as e:
            self.error.emit(str(e))
            return None
        return gen
