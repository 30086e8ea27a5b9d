"""The engine's events are declared once (core/serve/events.py) and reach listeners in
the (name, payload) form ui/bridge.py dispatches on, with the same keys as before."""

from __future__ import annotations

from dataclasses import fields

from core.options import EngineOptions
from core.serve import events as E
from core.serve.engine import Engine
from core.serve.sampling import SamplingParams
from tests.tiny_gguf import write_tiny_llama

BRIDGE_KEYS = {  # what ui/bridge.py and tests/test_reload.py read from each payload
    "model_loading": {"path", "progress", "message"},
    "model_loaded": {"info"},
    "model_error": {"path", "error", "cancelled"},
    "adapters_changed": {"adapters"},
    "adapters_dropped": {"dropped"},
    "mix_changed": {"mix", "source", "merge"},
    "request_started": {"id", "source", "mix", "prompt_n"},
    "request_finished": {"id", "source", "stop_type", "predicted_n", "timings", "error"},
}


def test_every_event_declares_the_keys_listeners_read():
    declared = {cls.name: {f.name for f in fields(cls)} for cls in E.EngineEvent.__subclasses__()}
    for name, keys in BRIDGE_KEYS.items():  # events may be added; these keep their keys
        assert declared[name] == keys, name


def test_a_load_and_a_request_reach_a_listener_as_name_and_payload(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1))
    seen: list[tuple[str, dict]] = []
    eng.subscribe(lambda name, payload: seen.append((name, payload)))
    eng.load_model(path)
    eng.start()
    try:
        eng.complete([1, 2, 3], SamplingParams(temperature=0.0, n_predict=2))
    finally:
        eng.stop()
    names = [n for n, _ in seen]
    assert names[0] == "model_loading" and "model_loaded" in names
    assert "request_started" in names and "request_finished" in names
    for name, payload in seen:
        if name in BRIDGE_KEYS:
            assert set(payload) == BRIDGE_KEYS[name], name
    done = dict(seen)["request_finished"]
    assert done["predicted_n"] == 2 and done["error"] is None
