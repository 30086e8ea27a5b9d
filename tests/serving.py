"""Building blocks of the engine and HTTP-server fixtures, one home for every test file.

A test module makes its module-scoped fixtures from these, so that loading the real
model once per module, starting the scheduler and serving it on a free loopback port
(and stopping both, in the right order) is written once:

    @pytest.fixture(scope="module")
    def engine(smollm_path, ref_dir):
        with running_engine(smollm_path, adapters=[ref_dir / "adapters" / "lora_attn.gguf"],
                            ctx_size=128, n_parallel=2) as eng:
            yield eng

    @pytest.fixture(scope="module")
    def server(engine):
        with serving(engine, api_keys=["k"]) as srv:
            yield srv
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from core.http.app import ServerSettings
from core.http.parsing import parse_lora
from core.http.server import ServerThread
from core.options import EngineOptions
from core.serve.engine import Engine


@contextlib.contextmanager
def running_engine(
    model: str | Path, *, adapters: Iterable[str | Path] = (), **options
) -> Iterator[Engine]:
    """An Engine(EngineOptions(**options)) with the model loaded, the adapters added at
    scale 0 (in order: ids 0, 1, ...) and the scheduler thread running; stopped on exit."""
    eng = Engine(EngineOptions(**options))
    eng.load_model(model)
    for path in adapters:
        eng.add_adapter(path, scale=0.0)
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


@contextlib.contextmanager
def serving(engine: Engine, **settings) -> Iterator[ServerThread]:
    """The HTTP server over ``engine`` on a free port of 127.0.0.1 (``srv.url``), with
    ServerSettings(**settings); stopped on exit (before the engine is)."""
    srv = ServerThread(engine, ServerSettings(port=0, **settings)).start()
    try:
        yield srv
    finally:
        srv.stop()


def wire_mix(engine, entries, what="lora"):
    """A mix in its HTTP wire form, read as the server reads it (core/http/parsing.py)."""
    return parse_lora(entries, what, [a["id"] for a in engine.adapters()])


def hold_training(
    monkeypatch, after: int | None = 1
) -> tuple[threading.Event, threading.Event, dict]:
    """(held, release, outcome): core.lora.vector_train.train patched so that the next
    control-vector training waits on its own thread after its ``after``-th pair (None:
    its last) until ``release`` is set, ``held`` set once it waits; events, not clocks.
    ``outcome`` gets the training's "dirs", or the "error" it ended with."""
    from core.lora import vector_train

    held, release, outcome = threading.Event(), threading.Event(), {}
    real_train = vector_train.train

    def holding_train(spec, render, run, *args, **kwargs):
        calls = []
        stop_at = spec.n_examples if after is None else after

        def run_then_hold(fn):
            out = run(fn)  # one pair's forwards, on the engine thread
            calls.append(1)
            if len(calls) == stop_at:  # on the training's thread
                held.set()
                assert release.wait(120)
            return out

        try:
            outcome["dirs"] = real_train(spec, render, run_then_hold, *args, **kwargs)
            return outcome["dirs"]
        except BaseException as e:
            outcome["error"] = e
            raise

    monkeypatch.setattr(vector_train, "train", holding_train)
    return held, release, outcome
