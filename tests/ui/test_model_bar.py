"""Opening models from the GUI: progress, info, recent list, and clean failures."""

from __future__ import annotations


def test_open_model_shows_progress_and_info(window, qtbot, smollm_path):
    w = window
    progress = []
    w.bridge.model_loading.connect(lambda ev: progress.append(ev.progress))
    with qtbot.waitSignal(w.bridge.model_loaded, timeout=60000):
        w.open_model(str(smollm_path))
    assert progress and max(progress) <= 1.0
    assert not w.model_bar.progress.isVisible()
    info = w.model_bar.info.full_text  # shown elided to the space it has, full in the tooltip
    tip = w.model_bar.info.toolTip()
    assert tip.startswith(info)
    # and the tooltip says what the RAM figure counts: the weights as held, and the KV
    info_d = w.engine.model_info()
    assert (
        "weights (quantized blocks read into memory)" in tip
        and f"at {info_d['n_ctx']} tokens" in tip
    )
    assert "llama" in info and "params" in info and "Q4_1" in info and "RAM" in info
    assert w.settings.recent_models()[0] == str(smollm_path)
    assert w.engine.ready


def test_bad_model_file_shows_error_and_keeps_the_old_model(window, qtbot, tmp_path):
    w = window
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"nonsense" * 10)
    with qtbot.waitSignal(w.bridge.model_error, timeout=10000):
        w.open_model(str(bad))
    assert w.banner.isVisible() and "Model not loaded" in w.banner.label.text()
    assert w.engine.ready  # the previous model stays in service
    w.mixer.bypass.setChecked(True)  # and the window keeps working


def test_cancel_after_the_weights_is_honoured_and_100_percent_means_done(
    loaded, qtbot, smollm_path, tmp_path, forget_calibration
):
    """Before: the bar showed "loaded from cache 100%" ~10 s before the end, and Cancel
    pressed then was ignored (the new model replaced the old one anyway)."""
    import shutil

    w = loaded
    other = tmp_path / "copy.gguf"  # another file: a finished load would change the path
    shutil.copy(smollm_path, other)
    seen, said = [], []
    w.statusBar().messageChanged.connect(said.append)

    def on_progress(ev):
        seen.append((ev.progress, ev.message))
        # past the weights: the compiled kernels' stage, which every load has
        if "compiled kernels" in ev.message and w.model_bar.cancel_btn.isVisible():
            w.model_bar.cancel_btn.click()

    w.bridge.model_loading.connect(on_progress)
    with qtbot.waitSignal(w.bridge.model_cancelled, timeout=120000):
        w.open_model(str(other))
    assert any("compiled kernels" in m for _, m in seen) and max(f for f, _ in seen) < 1.0
    assert w.engine.path == smollm_path and w.engine.ready
    assert {a["name"]: a["id"] for a in w.engine.adapters()} == w.ids
    assert not w.model_bar.progress.isVisible() and not w.model_bar.cancel_btn.isVisible()
    assert not w.banner.isVisible()  # a cancel is not an error
    assert any("Load cancelled" in m for m in said)


def test_an_f16_kv_cache_halves_the_kv_share_of_the_ram_figures(qtbot, smollm_path):
    """-ctk/-ctv f16: the model bar's RAM and Get a model's RAM needed are one figure
    again, both with the KV cache at 2 bytes a value, and the tooltip says so."""
    from test_get_model import _row
    from windows import close_window

    from core.model.kv_cache import kv_bytes
    from core.options import EngineOptions
    from core.serve.engine import Engine
    from core.settings import Settings
    from ui.main_window import MainWindow
    from ui.util import human_bytes

    opts = EngineOptions(ctx_size=1024, n_parallel=1, cache_type_k="f16", cache_type_v="f16")
    eng = Engine(opts)
    eng.load_model(smollm_path)
    w = MainWindow(eng, Settings())
    try:
        w.show()
        info = eng.model_info()
        half = kv_bytes(info["n_layers"], info["n_kv_heads"], info["head_dim"], 1024) // 2
        assert info["kv_bytes"] == half
        w.model_bar.show_info(info)
        shown = human_bytes(info["memory_bytes"] + half)
        assert f"{shown} RAM" in w.model_bar.info.full_text
        tip = w.model_bar.info.toolTip()
        assert f"at 1024 tokens {human_bytes(half)} (f16)" in tip
        dlg = w.model_bar.get_model()
        assert _row(dlg, "smollm2-135m")["RAM needed"] == shown
        dlg.close()
    finally:
        close_window(w, qtbot)
        eng.stop()
