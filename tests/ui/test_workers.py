"""ui.workers.Worker: the one way slow work runs off the GUI thread (issue #16)."""

from __future__ import annotations

import threading
import time

from ui.workers import Aborted, Worker


def test_a_function_returns_on_the_gui_thread(qtbot):
    gui = threading.get_ident()
    seen = []
    w = Worker(lambda x: (threading.get_ident(), x * 2), 21)
    w.started.connect(lambda: seen.append("started"))
    w.returned.connect(
        lambda v: seen.append(("returned", v[1], v[0] != gui, threading.get_ident() == gui))
    )
    w.finished.connect(lambda: seen.append("finished"))
    with qtbot.waitSignal(w.finished, timeout=5000):
        w.start()
    assert seen == ["started", ("returned", 42, True, True), "finished"]
    assert not w.running and w.wait(0)


def test_an_error_is_a_signal_not_a_raise(qtbot):
    def boom():
        raise OSError("disk gone")

    w = Worker(boom)
    errors = []
    w.errored.connect(errors.append)
    with qtbot.waitSignal(w.finished, timeout=5000):
        w.start()
    assert len(errors) == 1 and isinstance(errors[0], OSError)


def test_a_generator_yields_and_abort_closes_it_at_the_next_yield(qtbot):
    closed = threading.Event()

    def count():
        try:
            for i in range(10_000):
                yield i
                time.sleep(0.002)
        finally:
            closed.set()

    w = Worker(count)
    got, outcome = [], []
    w.yielded.connect(lambda v: (got.append(v), v == 3 and w.abort()))
    w.aborted.connect(lambda: outcome.append("aborted"))
    w.returned.connect(lambda v: outcome.append("returned"))
    with qtbot.waitSignal(w.finished, timeout=10000):
        w.start()
    assert outcome == ["aborted"] and closed.is_set() and 3 <= got[-1] < 100


def test_a_function_taking_abort_gets_the_event(qtbot):
    started = threading.Event()

    def wait_for_abort(abort: threading.Event):
        started.set()
        abort.wait(10)
        raise Aborted()

    w = Worker(wait_for_abort)
    outcome = []
    w.aborted.connect(lambda: outcome.append("aborted"))
    w.start()
    assert started.wait(5)
    with qtbot.waitSignal(w.finished, timeout=5000):
        w.abort()
    assert outcome == ["aborted"]


def test_check_raises_once_abort_was_asked():
    w = Worker(lambda: None)
    w.check()
    w.abort()
    try:
        w.check()
    except Aborted:
        pass
    else:
        raise AssertionError("check() did not raise after abort()")


def test_the_window_has_one_threading_style(window):
    """No QThread subclass and no raw threading.Thread left in ui/ besides workers.py."""
    from pathlib import Path

    import ui

    for f in Path(ui.__file__).parent.glob("*.py"):
        src = f.read_text(encoding="utf-8")
        if f.name != "workers.py":
            assert "threading.Thread(" not in src, f.name
            assert "(QThread)" not in src, f.name
        assert "setswitchinterval" not in src or f.name == "app.py", f.name
