"""Cyclic garbage is collected on the GUI thread only while the window runs: a Qt object
freed by a collection that a worker thread's allocations triggered crashed the whole
suite (a segfault in the tokenizer's load on a model-loading worker, at the same window
test, twice)."""

from __future__ import annotations

import gc
import threading
import weakref

from PySide6.QtCore import QObject

from ui.workers import GuiThreadGC, collect_on_gui_thread


def test_a_cycle_holding_a_qt_object_is_freed_on_the_gui_thread(window, qtbot):
    assert not gc.isenabled()  # the window turned automatic collection off

    class Holder(QObject):
        pass

    h = Holder()
    h.me = h  # a cycle: only the collector frees it
    ref = weakref.ref(h)
    del h

    kept = []

    def allocate():  # a worker allocating far past generation 0's threshold (kept alive,
        kept.append([[i] for i in range(200_000)])  # so the count stays past it)

    t = threading.Thread(target=allocate, name="worker")
    t.start()
    t.join()
    assert ref() is not None  # the worker's allocations collected nothing
    qtbot.waitUntil(lambda: ref() is None, timeout=5000)  # the GUI thread's timer did
    kept.clear()
    assert isinstance(collect_on_gui_thread(), GuiThreadGC)  # one guard, installed once
