"""Re-opening a model keeps the adapters that fit it, under their ids (issue #17 item 6).

Tiny random models: a 3-layer one and a 2-layer one with the same shapes, an adapter
on layer 0 (fits both) and one on layer 2 (fits only the 3-layer model)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from core.errors import HttpError
from core.model.weights import LoadCancelled
from core.options import EngineOptions
from core.serve.engine import Engine
from core.serve.events import AdaptersDropped, ModelLoaded, ModelLoading
from tests.serving import wire_mix
from tests.tiny_gguf import write_lora_gguf, write_tiny_llama

DIM, RANK = 64, 4


def lora_on_layer(path, layer: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    name = f"blk.{layer}.attn_q.weight"
    return write_lora_gguf(
        path,
        {
            f"{name}.lora_a": 0.1 * rng.standard_normal((RANK, DIM)),  # (r, d_in)
            f"{name}.lora_b": 0.1 * rng.standard_normal((DIM, RANK)),  # (d_out, r)
        },
        kv={"adapter.lora.alpha": 8.0},
    )


@pytest.fixture
def files(tmp_path):
    return {
        "three": write_tiny_llama(tmp_path / "three.gguf", n_layers=3, seed=1),
        "two": write_tiny_llama(tmp_path / "two.gguf", n_layers=2, seed=2),
        "l0": lora_on_layer(tmp_path / "l0.gguf", 0),
        "l2": lora_on_layer(tmp_path / "l2.gguf", 2, seed=3),
    }


@pytest.fixture
def events():
    return []


@pytest.fixture
def engine(files, events):
    eng = Engine(EngineOptions(ctx_size=64, n_parallel=1, draft_max=0))
    eng.load_model(files["three"])
    eng.subscribe(events.append)
    eng.start()
    yield eng
    eng.stop()


def test_reloading_the_same_file_keeps_adapters_ids_and_scales(engine, files, events):
    a = engine.add_adapter(files["l0"], scale=0.5)
    b = engine.add_adapter(files["l2"])
    engine.set_mix({a: 0.5, b: -1.25})
    engine.load_model(files["three"])
    assert [x["id"] for x in engine.adapters()] == [a, b] == [0, 1]
    assert engine.get_mix() == {a: 0.5, b: -1.25}
    # the HTTP form names adapters by id: id 0 is still the same adapter
    assert wire_mix(engine, [{"id": 0, "scale": 1.0}]) == {0: 1.0, 1: 0.0}
    assert engine.adapter(0).path == files["l0"]
    assert not [e for e in events if isinstance(e, AdaptersDropped)]
    # a new adapter gets a new id; the kept ones were not re-numbered
    assert engine.add_adapter(files["l0"]) == 2
    # and the engine serves with the kept adapter in the mix
    assert isinstance(
        engine.chat([{"role": "user", "content": "hi"}], mix={0: 1.0}, max_tokens=2), str
    )


def test_adapters_that_do_not_fit_the_new_model_are_dropped_with_the_reason(engine, files, events):
    a = engine.add_adapter(files["l0"], scale=0.75)
    b = engine.add_adapter(files["l2"], scale=1.0)
    engine.load_model(files["two"])
    assert [x["id"] for x in engine.adapters()] == [a]
    assert engine.get_mix() == {a: 0.75}
    with pytest.raises(HttpError, match="no adapter with id 1"):
        wire_mix(engine, [{"id": b, "scale": 1.0}])
    dropped = [e.dropped for e in events if isinstance(e, AdaptersDropped)]
    assert len(dropped) == 1 and [d["id"] for d in dropped[0]] == [b]
    entry = dropped[0][0]
    assert entry["path"] == str(files["l2"]) and entry["name"] == "l2"
    assert "l2.gguf" in entry["error"] and entry["error"].count("l2.gguf") == 1
    # the order of events lets a listener show the model first, then the red rows
    kinds = [type(e) for e in events if not isinstance(e, ModelLoading)]
    assert kinds.index(ModelLoaded) < kinds.index(AdaptersDropped)


def test_a_cancelled_reload_changes_nothing(engine, files):
    a = engine.add_adapter(files["l0"], scale=0.5)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        engine.load_model(files["two"], cancel=cancel)
    assert engine.path == files["three"] and engine.config.n_layers == 3
    assert [x["id"] for x in engine.adapters()] == [a] and engine.get_mix() == {a: 0.5}


def test_an_adapter_file_deleted_before_the_reload_becomes_a_dropped_entry(engine, files, events):
    a = engine.add_adapter(files["l0"])
    files["l0"].unlink()
    engine.load_model(files["three"])
    assert engine.adapters() == []
    (dropped,) = [e.dropped for e in events if isinstance(e, AdaptersDropped)]
    assert dropped[0]["id"] == a and "no such file" in dropped[0]["error"]


# -- the load's progress and Cancel (issue #17 item 7) ------------------------------


def test_progress_never_says_done_before_the_model_is_in_service(engine, files, forget_calibration):
    seen = []
    engine.load_model(files["three"], progress=lambda f, m: seen.append((f, m)))
    fracs = [f for f, _ in seen]
    assert fracs == sorted(fracs) and max(fracs) < 1.0
    # the weights are read from the file itself: the bar says so near the start, and
    # the products' timing that follows moves it on
    cached = [i for i, (_, m) in enumerate(seen) if "reading the weights" in m]
    assert cached and seen[cached[0]][0] < 0.1
    timing = [f for f, m in seen[cached[0] :] if "timing" in m]
    assert len(timing) > 3 and timing[-1] > 0.9


def test_cancel_during_the_products_timing_is_honoured(engine, files, forget_calibration):
    """Before: Cancel after the weights was ignored and the load went on for ~10 s."""
    a = engine.add_adapter(files["l0"], scale=0.5)
    cancel = threading.Event()

    def progress(frac, msg):
        if "timing" in msg:
            cancel.set()  # the user presses Cancel while the bar is past the weights

    with pytest.raises(LoadCancelled):
        engine.load_model(files["two"], progress=progress, cancel=cancel)
    assert engine.path == files["three"] and engine.config.n_layers == 3
    assert [x["id"] for x in engine.adapters()] == [a] and engine.get_mix() == {a: 0.5}
    assert engine.ready and not engine.loading
    assert isinstance(engine.chat([{"role": "user", "content": "hi"}], max_tokens=2), str)
