"""The engine's events are declared once (core/serve/events.py) and reach listeners as
the typed objects themselves, which ui/bridge.py re-emits on its signals by type."""

from __future__ import annotations

from dataclasses import fields

from core.options import EngineOptions
from core.serve import events as E
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.tiny_gguf import write_tiny_llama

FIELDS = {  # what ui/ and tests/test_reload.py read from each event
    E.ModelLoading: {"path", "progress", "message"},
    E.ModelLoaded: {"info"},
    E.ModelError: {"path", "error", "cancelled"},
    E.AdaptersChanged: {"adapters"},
    E.AdaptersDropped: {"dropped"},
    E.MixChanged: {"mix", "source", "merge"},
    E.VectorsChanged: {"vectors", "source"},
    E.MixBuilding: {"method", "progress", "message"},
    E.RequestStarted: {"id", "source", "mix", "prompt_n"},
    E.PromptProgress: {"id", "source", "done", "total"},
    E.RequestFinished: {"id", "source", "stop_type", "predicted_n", "timings", "error"},
    E.ChannelMeter: {"id", "source", "values", "vectors"},
}


def test_every_event_declares_the_fields_listeners_read():
    assert set(E.EngineEvent.__subclasses__()) == set(FIELDS)
    for cls, names in FIELDS.items():
        assert {f.name for f in fields(cls)} == names, cls.__name__


def test_a_load_and_a_request_reach_a_listener_as_typed_events(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    seen: list[E.EngineEvent] = []
    eng.subscribe(seen.append)
    eng.load_model(path)
    eng.start()
    try:
        eng.complete([1, 2, 3], SamplingParams(temperature=0.0, n_predict=2))
    finally:
        eng.stop()
    kinds = [type(e) for e in seen]
    assert kinds[0] is E.ModelLoading and E.ModelLoaded in kinds
    assert E.RequestStarted in kinds and E.RequestFinished in kinds
    (loaded,) = [e for e in seen if isinstance(e, E.ModelLoaded)]
    assert loaded.info["path"] == str(path)
    (done,) = [e for e in seen if isinstance(e, E.RequestFinished)]
    assert done.predicted_n == 2 and done.error is None and done.stop_type == "limit"


def test_listeners_hear_a_request_finish_before_its_caller_hears_it_done(tmp_path):
    """The window's strips go dark on RequestFinished and the chat pane ends its reply on
    the caller's DoneEvent: in that order, no strip is still lit after a reply ends."""
    import threading

    from core.serve.scheduler import DoneEvent

    ended = threading.Event()

    def on_event(ev):
        if isinstance(ev, DoneEvent):
            order.append("done")
            ended.set()

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    order: list[str] = []
    eng.subscribe(lambda e: isinstance(e, E.RequestFinished) and order.append("finished"))
    eng.load_model(path)
    eng.start()
    try:
        eng.submit([1, 2, 3], SamplingParams(temperature=0.0, n_predict=2), on_event)
        assert ended.wait(30)
    finally:
        eng.stop()
    assert order == ["finished", "done"]
