"""The one bridge between the engine (plain threads, no Qt) and the GUI thread.

* The engine runs its scheduler loop on its own thread (``engine.start()``), and
  restarts it across model reloads itself.
* :class:`EngineBridge` subscribes to the engine's typed events and re-emits each
  type on its own Qt signal, carrying the event object; signals emitted from
  another thread are queued to the GUI thread.
  It also runs slow calls (model load, adapter load, chat submissions) on
  :class:`ui.workers.Worker` threads and reports their outcome as signals, so
  widgets never block and never see an exception: errors arrive as ``error``
  signals.
* :class:`Generation` wraps one submitted request; its ``token`` and
  ``finished`` signals arrive on the GUI thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

from core.serve import events as E
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from core.serve.scheduler import DoneEvent, PromptProgressEvent, Timings

from .workers import Worker

log = logging.getLogger(__name__)


class Generation(QObject):
    """One request in flight. ``token(text)`` per released piece, then ``finished(done)``;
    both are emitted on the GUI thread (the scheduler thread only emits the private
    ``_raw_*`` signals, which Qt queues to this object's thread)."""

    token = Signal(str)
    finished = Signal(object)  # core.scheduler.DoneEvent
    prompt_progress = Signal(int, int)  # prompt tokens read so far, of total (per chunk)
    prompt_size = Signal(int)  # the prompt's tokens, as the engine counted them (admission)
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
        self.n_tokens = 0  # tokens generated so far (live tok/s), written by the scheduler
        self.prompt_n = 0  # the prompt's tokens (the engine's count), written by the scheduler
        self._raw_token.connect(self._append)
        self._raw_done.connect(self._store)

    def _on_event(self, ev) -> None:  # scheduler thread
        if isinstance(ev, DoneEvent):
            self._raw_done.emit(ev)
            return
        if isinstance(ev, PromptProgressEvent):  # queued to the GUI thread (our thread)
            self.prompt_n = ev.total
            if ev.start:  # the context bar counts the prompt from its admission
                self.prompt_size.emit(ev.total)
            else:  # the bar shows evaluated chunks (not the admission report)
                self.prompt_progress.emit(ev.done, ev.total)
            return
        self.n_tokens += 1
        if ev.text:
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
    # The engine's events (core/serve/events.py), re-emitted as the objects they are:
    model_loading = Signal(object)  # E.ModelLoading: progress 0..1, message
    model_loaded = Signal(object)  # E.ModelLoaded: info (Engine.model_info())
    model_error = Signal(object)  # E.ModelError, not cancelled
    model_cancelled = Signal(object)  # E.ModelError the user cancelled: the model in service stays
    adapters_changed = Signal(object)  # E.AdaptersChanged
    mix_changed = Signal(object)  # E.MixChanged: mix {id: scale}, source
    vectors_changed = Signal(object)  # E.VectorsChanged: vectors loaded, unloaded, rescaled
    mix_building = Signal(object)  # E.MixBuilding: a merged mix's first build, progress 0..1
    request_started = Signal(object)  # E.RequestStarted
    request_finished = Signal(object)  # E.RequestFinished
    channel_meter = Signal(object)  # E.ChannelMeter: a metered step of a running request
    # The bridge's own: the outcome of its workers' calls.
    adapter_added = Signal(int, str)  # id, path
    adapter_error = Signal(str, str)  # path, message (a failed load, or dropped by a reload)
    error = Signal(str)  # anything else worth a message

    def __init__(self, engine: Engine, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        self.load_worker: Worker | None = None
        self._workers: set[Worker] = set()  # referenced until they finish
        self._signals = {
            E.ModelLoading: self.model_loading,
            E.ModelLoaded: self.model_loaded,
            E.AdaptersChanged: self.adapters_changed,
            E.MixChanged: self.mix_changed,
            E.VectorsChanged: self.vectors_changed,
            E.MixBuilding: self.mix_building,
            E.RequestStarted: self.request_started,
            E.RequestFinished: self.request_finished,
            E.ChannelMeter: self.channel_meter,
        }  # PromptProgress: each Generation hears its own request's
        self._unsubscribe = engine.subscribe(self._on_engine_event)

    # -- engine events (any thread) -> signals -------------------------------------
    def _on_engine_event(self, ev: E.EngineEvent) -> None:
        if isinstance(ev, E.ModelError):
            (self.model_cancelled if ev.cancelled else self.model_error).emit(ev)
        elif isinstance(ev, E.AdaptersDropped):  # a reload unloaded those that do not fit
            for d in ev.dropped:
                self.adapter_error.emit(str(d.get("path", "")), str(d.get("error", "")))
        elif type(ev) in self._signals:
            self._signals[type(ev)].emit(ev)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Serve requests: the engine's loop thread (a no-op until a model is loaded;
        a load started here starts it when it completes)."""
        self.engine.start()

    def shutdown(self) -> None:
        self.cancel_load()
        self._unsubscribe()
        self.engine.stop()

    def run(self, fn, *args, **kwargs) -> Worker:
        """A Worker for ``fn`` kept alive until it finishes; connect, then start()."""
        worker = Worker(fn, *args, **kwargs)
        self._workers.add(worker)
        worker.finished.connect(lambda: self._workers.discard(worker))
        return worker

    # -- slow work on worker threads ------------------------------------------------------
    @property
    def loading(self) -> bool:
        return self.load_worker is not None and self.load_worker.running

    def load_model(self, path, adapters: list[tuple[str, float]] = ()) -> Worker:
        """Load a model off the GUI thread, then the given adapters. Progress, success
        and failure arrive through the model_* and adapter_* signals; Cancel is
        ``cancel_load()`` (the worker's abort event is the engine's cancel event)."""
        if self.load_worker is not None:
            self.load_worker.abort()

        def load(abort: threading.Event) -> None:
            target = path
            if callable(path):  # e.g. ensure_default_model: may download once
                self.model_loading.emit(E.ModelLoading("", 0.0, "fetching the default model"))
                try:
                    target = path()
                except Exception as e:
                    error = f"could not get the default model: {e}"
                    self.model_error.emit(E.ModelError("", error, cancelled=False))
                    return
            try:
                self.engine.load_model(target, cancel=abort)
            except BaseException as e:  # the engine already sent model_error
                log.info("model load failed%s: %s", " (cancelled)" if abort.is_set() else "", e)
                return
            self.engine.start()  # the first model: serve from now on (a reload restarts it)
            for apath, scale in adapters:
                self._add_adapter_now(apath, scale)

        worker = self.load_worker = self.run(load, name="mixdesk-load")
        return worker.start()

    def cancel_load(self) -> None:
        if self.load_worker is not None:
            self.load_worker.abort()

    def add_adapter(self, path: str | Path, scale: float = 0.0) -> Worker:
        return self.run(self._add_adapter_now, path, scale, name="mixdesk-adapter").start()

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
        """Set the engine's global mix: its adapters, and its control vectors when the
        mix names them (a Mix's ``vectors``; None leaves the engine's vectors)."""
        try:
            self.engine.set_mix(mix, source="gui", replace=True)  # a Mix keeps its method
            vectors = getattr(mix, "vectors", None)
            if vectors is not None:
                self.engine.set_control_vectors(vectors, replace=True, source="gui")
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
                                progress=True,
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

        worker = self.run(work, name="mixdesk-submit")
        QTimer.singleShot(0, worker.start)  # after the caller has connected its slots
        return gens

    def _refuse(self, gen: Generation, e: Exception) -> None:
        self.error.emit(str(e))
        gen._raw_done.emit(DoneEvent("error", "", [], Timings(), (), error=str(e)))
