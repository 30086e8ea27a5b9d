"""File > New control vector… driven for real: a template fills the pairs, a tiny run
makes a vector that loads into the session engine, Cancel stops a run with no file,
and a bad form says why without running."""

from __future__ import annotations

import pytest

from core.lora.control import load_control_vector
from core.paths import data_dir
from tests.serving import hold_training


@pytest.fixture
def dialog(make_window, qtbot):
    win = make_window()
    dlg = win.new_control_vector()
    qtbot.addWidget(dlg)
    yield dlg
    if dlg.running:
        dlg.worker.abort()
        dlg.worker.wait(60)
    eng = win.engine
    for v in eng.control_vectors():  # the session engine is shared: leave no vector
        eng.remove_control_vector(v["id"])


def test_a_template_run_makes_and_loads_a_vector(dialog, qtbot):
    eng = dialog.bridge.engine
    dialog.template.setCurrentIndex(dialog.template.findData("formal-casual"))
    assert dialog.name.text() == "formal-casual"
    assert dialog.table_pairs()[0]["positive"].startswith("Reply in a very formal")
    dialog.pairs.setRowCount(1)  # a tiny run: one pair, the bare prompt only
    dialog.suffixes.setPlainText("")
    dialog.method.setCurrentText("mean")
    dialog.scale.setValue(0.25)
    with qtbot.waitSignal(dialog.made, timeout=120_000) as got:
        dialog.make_btn.click()
    vid, path = got.args
    assert path == str(data_dir() / "adapters" / "formal-casual.gguf")
    assert [(v["id"], v["scale"], v["name"]) for v in eng.control_vectors()] == [
        (vid, 0.25, "formal-casual")
    ]
    # the middle band by default, as the demo vector's: layers 5..20 of SmolLM2's 30
    assert (dialog.first.value(), dialog.last.value()) == (5, 20)
    assert load_control_vector(path, eng.config).layers == tuple(range(5, 21))
    # the desk's mix names no vectors: it runs under the new one, at its scale
    from ui.desk import desk_mix

    key, _ = eng.lora.built(desk_mix({}))
    assert key.steer == ((vid, 0.25),)
    assert dialog.progress.value() == dialog.progress.maximum() == 1
    assert "Loaded formal-casual" in dialog.status.text()
    # the same name again: refused in the form, nothing runs
    dialog.start()
    assert "exists already" in dialog.status.text() and not dialog.running


def test_cancel_stops_a_run_and_writes_nothing(dialog, qtbot):
    eng = dialog.bridge.engine
    dialog.template.setCurrentIndex(dialog.template.findData("happy-sad"))
    dialog.name.setText("cancelled-one")
    # Cancel as soon as the first example is in
    dialog.progressed.connect(lambda i, n: i == 1 and dialog.cancel_btn.click())
    with qtbot.waitSignal(dialog.cancelled, timeout=120_000):
        dialog.make_btn.click()
    assert dialog.progress.value() == 0 and "Cancelled" in dialog.status.text()
    assert not (data_dir() / "adapters" / "cancelled-one.gguf").exists()
    assert eng.control_vectors() == []
    assert dialog.make_btn.isEnabled() and dialog.isVisible()  # Cancel stopped, not closed


def test_a_bad_form_says_why_and_runs_nothing(dialog):
    dialog.template.setCurrentIndex(0)  # Custom: the table keeps what it had
    dialog.pairs.setRowCount(0)
    dialog.start()
    assert "no pairs" in dialog.status.text() and not dialog.running
    dialog._add_pair("Be happy.", "")
    dialog.start()
    assert "negative must not be empty" in dialog.status.text() and not dialog.running
    dialog.pairs.setRowCount(0)
    dialog._add_pair("Be happy.", "Be sad.")
    dialog.first.setValue(9)
    dialog.last.setValue(3)
    dialog.start()
    assert "layers must be" in dialog.status.text() and not dialog.running


def test_closing_mid_run_cancels_it_even_in_the_last_pair(dialog, qtbot, monkeypatch):
    """Closing the window while a vector is being made cancels the run, also when it
    comes during the last pair (the file and the load still to come): nothing written,
    nothing loaded. The run is held after its last pair by an event, not a clock."""
    held, release, _ = hold_training(monkeypatch, after=None)  # after the last pair
    eng = dialog.bridge.engine
    dialog.template.setCurrentIndex(dialog.template.findData("happy-sad"))
    dialog.pairs.setRowCount(1)
    dialog.suffixes.setPlainText("I")
    dialog.name.setText("closed-one")
    made, cancelled = [], []
    dialog.made.connect(lambda *a: made.append(a))
    dialog.cancelled.connect(lambda: cancelled.append(1))
    try:
        dialog.make_btn.click()
        qtbot.waitUntil(held.is_set, timeout=120_000)
        dialog.close()  # the window's close button: reject() aborts the run
    finally:
        release.set()
    qtbot.waitUntil(lambda: bool(made or cancelled), timeout=120_000)  # the outcome
    assert made == [] and cancelled == [1] and "Cancelled" in dialog.status.text()
    assert not (data_dir() / "adapters" / "closed-one.gguf").exists()
    assert eng.control_vectors() == []
