"""GUI test fixtures: offscreen Qt, one real SmolLM2 engine for the session, the
reference adapters, and a fresh MainWindow per test (settings isolated by the
autouse MIXDESK_HOME fixture in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"  # before anything imports Qt

import pytest  # noqa: E402
from windows import close_window  # noqa: E402

ADAPTERS = ("lora_all_q8", "lora_attn", "lora_ffn")


@pytest.fixture(scope="session")
def engine(smollm_path):
    from core.options import EngineOptions
    from core.serve.engine import Engine

    eng = Engine(EngineOptions(ctx_size=1024, n_parallel=4))
    eng.load_model(smollm_path)
    yield eng
    eng.stop()


@pytest.fixture
def clean_engine(engine):
    """The session engine with no adapters, no control vectors and an empty, linear mix."""
    from core.lora.merge import LINEAR

    for a in engine.adapters():
        engine.remove_adapter(a["id"])
    for v in engine.control_vectors():  # a vector's strip would stay on the next desk
        engine.remove_control_vector(v["id"])
    engine.set_mix({}, merge=LINEAR)
    return engine


@pytest.fixture
def make_window(qtbot, clean_engine):
    from core.settings import Settings
    from ui.main_window import MainWindow

    made = []

    def make():
        from PySide6.QtCore import QCoreApplication, QEvent

        # earlier windows are deleted first: the new one's theme may re-polish every widget
        QCoreApplication.sendPostedEvents(None, QEvent.DeferredDelete)
        win = MainWindow(clean_engine, Settings())
        win.show()
        made.append(win)
        return win

    yield make
    for win in made:  # closed here, not by qtbot: the server must stop first
        close_window(win, qtbot)


@pytest.fixture
def window(make_window):
    return make_window()


@pytest.fixture
def loaded(window, qtbot, ref_dir):
    """The window with the three reference adapters loaded (ids in ADAPTERS order)."""
    window.adapters.add_paths([ref_dir / "adapters" / f"{n}.gguf" for n in ADAPTERS])
    qtbot.waitUntil(lambda: len(window.mixer.strips) == 3, timeout=10000)
    ids = {a["name"]: a["id"] for a in window.engine.adapters()}
    window.ids = ids
    return window


def _greedy(window, n_predict: int = 6) -> None:
    window.sampling.set_values(
        {
            "temperature": 0.0,
            "n_predict": n_predict,
            "seed": 0,
            "repeat_penalty": 1.0,
            "top_k": 40,
            "top_p": 1.0,
            "min_p": 0.0,
        }
    )


@pytest.fixture
def greedy():
    """greedy(window, n_predict): temperature 0 and a small token budget."""
    return _greedy


@pytest.fixture
def qloop(qapp):
    """A qasync loop driven by the Qt event loop that qtbot spins (as in the app)."""
    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)
    loop._QEventLoop__is_running = False  # we never ran it ourselves: let close() proceed
    loop.close()  # joins the loop's executor threads


@pytest.fixture(scope="session", autouse=True)
def _tidy_qt_at_exit(qapp):
    """As ui.app.teardown: free Qt objects before interpreter finalization, where
    shiboken can abort while collecting them (PySide6 6.12, seen intermittently)."""
    yield
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent

    qapp.processEvents()
    QCoreApplication.sendPostedEvents(None, QEvent.DeferredDelete)
    gc.collect()
    gc.freeze()
