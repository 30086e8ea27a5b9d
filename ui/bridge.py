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
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, QTimer, Signal

from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from core.serve.scheduler import DoneEvent, Timings

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.001


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
            if sched is None or sched is ran:  # no model yet, or a reload in progress
                self._quit.wait(0.02)
                continue
            ran = sched
            try:
                self.engine.run_loop()
            except Exception:  # never let the engine thread die silently
                log.exception("engine loop failed")
                self._quit.wait(0.2)
                ran = None

    def shutdown(self, timeout_ms: int = 5000) -> None:
        self._quit.set()
        self.engine.stop()
        self.wait(timeout_ms)


class Generation(QObject):
    """One request in flight. ``token(text)`` per released piece, then ``finished(done)``;
    both are emitted on the GUI thread (the scheduler thread only emits the private
    ``_raw_*`` signals, which Qt queues to this object's thread)."""

    token = Signal(str)
    finished = Signal(object)  # core.scheduler.DoneEvent
    _raw_token = Signal(str)
    _raw_done = Signal(object)

    def __init__(self, tag: Any = None, parent: QObject | None = None):
        super().__init__(parent)
        self.tag = tag
        self.request = None
        self._cancel_early = False
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._flush_queued = False
        self.done: DoneEvent | None = None
        self.text = ""
        self._raw_token.connect(self._append)
        self._raw_done.connect(self._store)

    def _on_event(self, ev) -> None:  # scheduler thread
        if isinstance(ev, DoneEvent):
            self._raw_done.emit(ev)
        elif ev.text:
            # Coalesce: one queued signal per GUI wake-up, however many tokens arrive,
            # so a fast stream costs the GUI thread one slot call per event-loop pass.
            with self._lock:
                self._pending.append(ev.text)
                if self._flush_queued:
                    return
                self._flush_queued = True
            self._raw_token.emit("")

    def _append(self, _: str = "") -> None:
        with self._lock:
            text = "".join(self._pending)
            self._pending.clear()
            self._flush_queued = False
        if text and self.done is None:
            self.text += text
            self.token.emit(text)

    def _store(self, done: DoneEvent) -> None:
        self._append()  # tokens still buffered come first
        if self.done is None:
            self.done = done
            self.finished.emit(done)

    @property
    def running(self) -> bool:
        return self.done is None

    def cancel(self) -> None:
        self._cancel_early = True  # if the worker has not submitted it yet
        if self.request is not None:
            self.request.cancel()


class EngineBridge(QObject):
    model_loading = Signal(float, str)
    model_loaded = Signal(object)
    model_error = Signal(str)
    model_cancelled = Signal()  # the user's Cancel: the model in service stays
    adapters_changed = Signal(object)
    mix_changed = Signal(object, str)  # {id: scale}, source
    request_started = Signal(object)
    request_finished = Signal(object)
    adapter_added = Signal(int, str)  # id, path
    adapter_error = Signal(str, str)  # path, message
    error = Signal(str)  # anything else worth a message

    def __init__(self, engine: Engine, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        # The engine thread holds the GIL between numpy calls; a short switch interval
        # bounds how long the GUI thread waits each time it re-enters Python.
        sys.setswitchinterval(GIL_SWITCH_S)
        self.thread = EngineThread(engine)
        self._cancel_load: threading.Event | None = None
        self._unsubscribe = engine.subscribe(self._on_engine_event)

    # -- engine events (any thread) -> signals -------------------------------------
    def _on_engine_event(self, name: str, payload: dict) -> None:
        if name == "model_loading":
            self.model_loading.emit(
                float(payload.get("progress", 0.0)), str(payload.get("message", ""))
            )
        elif name == "model_loaded":
            self.model_loaded.emit(dict(payload.get("info") or {}))
        elif name == "model_error" and payload.get("cancelled"):
            self.model_cancelled.emit()
        elif name == "model_error":
            self.model_error.emit(str(payload.get("error", "model load failed")))
        elif name == "adapters_changed":
            self.adapters_changed.emit(list(payload.get("adapters") or []))
        elif name == "adapters_dropped":  # a reload unloaded those that do not fit
            for d in payload.get("dropped") or []:
                self.adapter_error.emit(str(d.get("path", "")), str(d.get("error", "")))
        elif name == "mix_changed":
            self.mix_changed.emit(dict(payload.get("mix") or {}), str(payload.get("source", "")))
        elif name == "request_started":
            self.request_started.emit(dict(payload))
        elif name == "request_finished":
            self.request_finished.emit(dict(payload))

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
                if callable(path):  # e.g. ensure_default_model: may download once
                    self.model_loading.emit(0.0, "fetching the default model")
                    try:
                        target = path()
                    except Exception as e:
                        self.model_error.emit(f"could not get the default model: {e}")
                        return
                try:
                    self.engine.load_model(target, cancel=cancel)
                except BaseException as e:  # the engine already sent model_error
                    log.info(
                        "model load failed%s: %s", " (cancelled)" if cancel.is_set() else "", e
                    )
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
        threading.Thread(
            target=self._add_adapter_now, args=(path, scale), name="mixdesk-adapter", daemon=True
        ).start()

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
    def chat(
        self,
        messages: list[dict],
        params: SamplingParams,
        mix: Mapping[int, float] | None = None,
        tag: Any = None,
    ) -> Generation:
        return self.chat_many([(messages, params, mix, tag)])[0]

    def chat_many(
        self, jobs: list[tuple[list[dict], SamplingParams, Mapping | None, Any]]
    ) -> list[Generation]:
        """Submit chat requests together (A/B compare) from a worker thread: templating
        and building a new mix's stacked weights can take tens of ms, which must not
        stall the GUI. Each request snapshots the global mix at submission when its mix
        is None. A refused request finishes at once with stop_type "error"."""
        gens = [Generation(tag) for *_, tag in jobs]  # owned by the caller

        def work() -> None:
            prepared = []
            for (messages, params, mix, _), gen in zip(jobs, gens):
                try:
                    prepared.append(
                        (
                            gen,
                            dict(
                                prompt=self.engine.chat_prompt(messages),
                                params=params,
                                on_event=gen._on_event,
                                mix=mix,
                                source="gui",
                            ),
                        )
                    )
                except Exception as e:
                    self._refuse(gen, e)
            try:
                # admitted in the same scheduler step, so they run batched side by side
                results = self.engine.submit_many([job for _, job in prepared])
            except Exception as e:
                for gen, _ in prepared:
                    self._refuse(gen, e)
                return
            for (gen, _), got in zip(prepared, results):
                if isinstance(got, Exception):
                    self._refuse(gen, got)
                    continue
                gen.request = got
                if gen._cancel_early:
                    got.cancel()

        worker = threading.Thread(target=work, name="mixdesk-submit", daemon=True)
        QTimer.singleShot(0, worker.start)  # after the caller has connected its slots
        return gens

    def _refuse(self, gen: Generation, e: Exception) -> None:
        self.error.emit(str(e))
        gen._raw_done.emit(DoneEvent("error", "", [], Timings(), (), error=str(e)))
