"""File → Export mix: the desk's effective mix is exported off the GUI thread, the
result reproduces the mix, Cancel leaves nothing behind, and an empty mix is refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from PySide6.QtWidgets import QFileDialog, QInputDialog, QPushButton

from core.lora.adapter import load_adapter
from tests.mixing import mix_logits

PROMPT = "Once upon a time, in a small village by the sea,"


def logits(eng, mix: dict[int, float], tokens: list[int]) -> np.ndarray:
    """All-position logits of ``tokens`` under ``mix`` (as tests/test_export.py)."""
    return mix_logits(eng, mix, tokens)


@pytest.fixture
def save_to(monkeypatch):
    """save_to(path): the save dialog answers ``path``; returns the list of its calls."""
    calls = []

    def install(path):
        def fake(*args, **kwargs):
            calls.append(args)
            return (str(path) if path else "", "")

        monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(fake))
        return calls

    return install


def desk(w, attn=0.0, ffn=0.0, allq=0.0):
    for name, value in (("lora_attn", attn), ("lora_ffn", ffn), ("lora_all_q8", allq)):
        w.mixer.strips[w.ids[name]].spin.setValue(value)


def test_export_lora_from_the_menu_reproduces_the_desk_mix(loaded, qtbot, tmp_path, save_to):
    w, ids = loaded, loaded.ids
    desk(w, attn=0.6, ffn=-0.4, allq=1.0)
    w.mixer.strips[ids["lora_all_q8"]].on.setChecked(False)  # muted: not in the export
    mix = w.engine.get_mix()
    assert mix == {ids["lora_attn"]: 0.6, ids["lora_ffn"]: -0.4, ids["lora_all_q8"]: 0.0}
    out = tmp_path / "desk_mix.gguf"
    calls = save_to(out)
    assert w.exporter.menu.title() == "&Export mix"
    assert [a.text() for a in w.exporter.menu.actions()] == [
        "As LoRA adapter (.gguf)…",
        "As merged model (.gguf)…",
        "As PEFT folder…",
    ]

    seen, gui = [], threading.get_ident()
    with qtbot.waitSignal(w.exporter.finished, timeout=20000) as blocker:
        w.exporter.actions["lora"].trigger()
        worker = w.exporter.worker
        assert worker is not None and w.exporter.dialog.isVisible()
        worker.progressed.connect(lambda f, m: seen.append((f, threading.get_ident())))
    res = blocker.args[0]
    assert len(calls) == 1 and res is not None and res.path == out and out.is_file()
    assert seen and seen[-1][0] == 1.0 and {t for _, t in seen} == {gui}  # queued to the GUI
    assert not w.banner.isVisible()
    status = w.statusBar().currentMessage()
    assert str(out) in status and ("KiB" in status or "MiB" in status)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["desk_mix.gguf"]  # no temp file
    qtbot.waitUntil(lambda: w.exporter.worker is None, timeout=5000)
    assert w.exporter.actions["lora"].isEnabled()

    eng = w.engine
    ad = load_adapter(out, eng.config)
    assert ad.rank == 16 and set(ad.tensors) >= {"blk.0.attn_q.weight", "blk.0.ffn_up.weight"}
    tokens = eng.tokenizer.encode(PROMPT)
    want = logits(eng, mix, tokens)
    aid = eng.add_adapter(out)  # the export alone, at scale 1
    got = logits(eng, {aid: 1.0}, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want - logits(eng, {}, tokens)).max() > 0.1  # the mix does change them


def test_cancel_during_merged_export_leaves_nothing(loaded, qtbot, tmp_path, save_to, monkeypatch):
    w = loaded
    desk(w, attn=0.5, ffn=0.5)
    target = tmp_path / "out"
    target.mkdir()
    save_to(target / "merged.gguf")
    asked = []

    def pick_type(parent, title, label, items, current, editable):
        asked.append(items[current])
        return items[current], True  # the default: f16

    monkeypatch.setattr(QInputDialog, "getItem", staticmethod(pick_type))

    during = []

    def on_progress(frac, msg):
        if frac > 0 and not during and w.exporter.dialog is not None:
            during.append(sorted(p.name for p in target.iterdir()))
            w.exporter.dialog.findChild(QPushButton).click()  # the dialog's Cancel button

    with qtbot.waitSignal(w.exporter.finished, timeout=30000) as blocker:
        w.exporter.actions["merged"].trigger()
        assert w.exporter.worker.outtype == "f16" and asked[0].startswith("f16")
        w.exporter.worker.progressed.connect(on_progress)
    qtbot.waitUntil(lambda: w.exporter.worker is None, timeout=10000)
    assert blocker.args == [None]
    assert during and during[0] and during[0][0].endswith(".partial")  # it was mid-write
    assert list(target.iterdir()) == []  # nothing left
    assert "cancelled" in w.statusBar().currentMessage()
    assert not w.banner.isVisible()


def test_empty_mix_is_refused_with_a_message(loaded, qtbot, tmp_path, save_to):
    w = loaded
    calls = save_to(tmp_path / "never.gguf")
    desk(w, attn=0.7)
    w.mixer.bypass.setChecked(True)  # faders up, but bypassed: nothing plays
    for kind in ("lora", "merged", "peft"):
        w.banner.hide()
        with qtbot.waitSignal(w.exporter.finished, timeout=2000) as blocker:
            w.exporter.actions[kind].trigger()
        assert blocker.args == [None] and w.exporter.worker is None
        assert w.banner.isVisible() and "Nothing to export" in w.banner.label.text()
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_peft_export_and_errors_use_the_inline_banner(loaded, qtbot, tmp_path, save_to):
    w = loaded
    desk(w, ffn=0.8)
    save_to(tmp_path / "peft")
    with qtbot.waitSignal(w.exporter.finished, timeout=20000) as blocker:
        w.exporter.actions["peft"].trigger()
    assert blocker.args[0] is not None
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    qtbot.waitUntil(lambda: w.exporter.worker is None, timeout=5000)
    save_to(tmp_path / "missing" / "mix.gguf")  # a folder that does not exist
    with qtbot.waitSignal(w.exporter.finished, timeout=20000) as blocker:
        w.exporter.actions["lora"].trigger()
    assert blocker.args == [None]
    assert w.banner.isVisible() and w.banner.label.text().startswith("Export failed: ")
    assert "does not exist" in w.banner.label.text()


def test_closing_the_window_cancels_a_running_export(loaded, qtbot, tmp_path, save_to):
    w = loaded
    desk(w, attn=0.5)
    save_to(tmp_path / "merged.gguf")
    worker = w.exporter.start("merged", tmp_path / "merged.gguf", "f32")
    assert worker is not None and worker.running
    w.close()  # cancels and waits for the thread
    assert worker.done.is_set() and worker.abort_requested
    qtbot.waitUntil(lambda: w.exporter.worker is None, timeout=5000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kind,name,at",
    [("lora", "mix.gguf", "writing tensors"), ("peft", "mix_peft", "writing adapter_model")],
)
def test_cancel_while_writing_leaves_nothing(loaded, tmp_path, kind, name, at):
    """Cancel at core's last step before the rename (the file or folder already exists):
    run synchronously, so the moment is exact."""
    from ui.export import ExportWorker

    w = loaded
    desk(w, attn=0.5, ffn=-0.5)
    worker = ExportWorker(w.engine, kind, w.exporter.current_mix(), tmp_path / name)
    report, outcome = worker._progress, []

    def progress(frac, msg):
        if msg.startswith(at):
            worker.abort()
        report(frac, msg)

    worker._progress = progress
    worker.aborted.connect(lambda: outcome.append("cancelled"))
    worker.returned.connect(lambda r: outcome.append(r))
    worker._run()  # on this thread
    assert outcome == ["cancelled"]
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_merged_desk_mix_is_its_merged_adapter(loaded, qtbot, tmp_path, save_to):
    """#21: with a merge method on the desk, File → Export writes the merged adapter the
    mix runs with (svd to rank 4 here: it builds in milliseconds; tests/test_merge.py
    exports ties and dare_ties): same logits as the live merged mix, at rank 4."""
    w = loaded
    desk(w, attn=0.6, ffn=-0.4, allq=1.0)
    w.mixer.method.setCurrentText("svd")
    w.mixer.rank.setValue(4)
    mix = w.engine.get_mix()
    assert mix.merge.method == "svd" and mix.merge.rank == 4
    out = tmp_path / "merged_mix.gguf"
    save_to(out)
    # a generous wait: building 210 modules' merge is seconds, minutes on a loaded machine
    with qtbot.waitSignal(w.exporter.finished, timeout=600000) as blocker:
        w.exporter.actions["lora"].trigger()
    assert blocker.args[0] is not None and out.is_file()
    eng = w.engine
    ad = load_adapter(out, eng.config)
    assert ad.rank == 4
    tokens = eng.tokenizer.encode(PROMPT)
    aid = eng.add_adapter(out, scale=0.0)
    try:
        np.testing.assert_allclose(
            logits(eng, {aid: 1.0}, tokens), logits(eng, mix, tokens), atol=2e-3, rtol=0
        )
    finally:
        eng.remove_adapter(aid)


@pytest.mark.parametrize("kind", ["lora", "merged"])
def test_a_mix_with_a_control_vector_exports_it_beside_and_says_so(
    loaded, qtbot, tmp_path, save_to, ref_dir, monkeypatch, kind
):
    """The desk steers with a control vector: the export writes the vector file beside
    the mix, the progress dialog says where (and, for a merged model, that the vector
    is not folded in), the status line names it, and it loads back as a vector."""
    from core.lora.control import load_control_vector
    from core.lora.export import CANNOT_FOLD

    w = loaded
    desk(w, attn=0.5)
    vid = w.engine.add_control_vector(ref_dir / "control_vectors" / "cv_a.gguf", 0.8)
    monkeypatch.setattr(QInputDialog, "getItem", staticmethod(lambda *a, **k: (a[3][0], True)))
    out = tmp_path / f"steered-{kind}.gguf"
    save_to(out)
    try:
        with qtbot.waitSignal(w.exporter.finished, timeout=120000) as blocker:
            w.exporter.actions[kind].trigger()
            label = w.exporter.dialog.labelText()
            if kind == "merged":  # the dialog's word is what is tested; no 270 MB write
                w.exporter.dialog.findChild(QPushButton).click()
        res = blocker.args[0]
    finally:
        w.engine.remove_control_vector(vid)
        desk(w)
    side = tmp_path / f"steered-{kind}.cvec.gguf"
    if kind == "merged":
        assert CANNOT_FOLD in label and side.name in label
        assert res is None and not side.exists()  # cancelled: nothing written
        return
    assert res.vectors == side and side.is_file() and out.is_file()
    assert side.name in label and CANNOT_FOLD not in label
    assert side.name in w.statusBar().currentMessage()
    back = load_control_vector(side, w.engine.config)
    assert back.layers and back.directions.any()
