"""Defects a new user met on the real window (issue #36), each reproduced first."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import QPoint, Qt
from test_defects import LONG_INFO

from core.serve.events import ModelLoaded


# -- 1. Preset Delete loses data --------------------------------------------------------------
def test_deleting_a_preset_offers_undo_and_ctrl_z_brings_it_back(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    m = w.mixer
    m.strips[aid].spin.setValue(0.7)
    m.save_preset("pirate")
    m.preset_box.setCurrentText("pirate")
    m.delete_action.trigger()
    assert w.settings.presets.names() == []
    assert json.loads(w.settings.presets.path.read_text()) == {}
    assert m.preset_undo.isVisible() and "pirate" in m.preset_undo.label.text()
    m.preset_undo.button.click()  # the Undo bar
    assert w.settings.presets.names() == ["pirate"]
    assert m.preset_box.currentText() == "pirate" and not m.preset_undo.isVisible()
    assert m.mix_for_preset("pirate")[aid] == pytest.approx(0.7)

    m.delete_action.trigger()
    assert w.settings.presets.names() == []
    w.activateWindow()
    m.setFocus()
    qtbot.keyClick(m, Qt.Key_Z, Qt.ControlModifier)  # Ctrl+Z, as for the mix
    assert w.settings.presets.names() == ["pirate"]
    assert "pirate" in json.loads(w.settings.presets.path.read_text())
    assert m.strips[aid].value == pytest.approx(0.7)  # the undo did not also move the mix


def test_rename_and_delete_are_disabled_with_no_preset_selected(loaded):
    m = loaded.mixer
    assert m.preset_box.currentText() == ""
    assert not m.rename_action.isEnabled() and not m.delete_action.isEnabled()
    m.save_preset("one")
    assert m.preset_box.currentText() == "one"
    assert m.rename_action.isEnabled() and m.delete_action.isEnabled()
    m.delete_action.trigger()
    assert not m.rename_action.isEnabled() and not m.delete_action.isEnabled()


# -- 2. A failed server start squeezes the desk ----------------------------------------------
@pytest.fixture
def styled(qapp):
    """The real window's style and stylesheet (sizes depend on them)."""
    from ui.app import load_stylesheet

    old = qapp.styleSheet()
    qapp.setStyleSheet(load_stylesheet())
    yield
    qapp.setStyleSheet(old)


@pytest.fixture
def busy_port():
    """A port another program listens on."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _start_server(w, qtbot) -> bool:
    import asyncio

    fut = asyncio.ensure_future(w.server.start())
    qtbot.waitUntil(fut.done, timeout=10000)
    return fut.result()


def test_a_busy_port_says_so_plainly_logs_it_and_moves_no_splitter(
    loaded, qloop, qtbot, styled, busy_port
):
    w = loaded
    w.resize(1024, 700)
    w.tabs.setCurrentIndex(3)  # Server
    qtbot.wait(50)
    sizes = w.splitter.sizes()
    w.server.host.setText("127.0.0.1")
    w.server.port.setValue(busy_port)
    assert not _start_server(w, qtbot)
    qtbot.wait(50)
    assert w.splitter.sizes() == sizes  # no layout jump
    plain = f"Port {busy_port} is already in use — pick another port or stop the program using it"
    assert plain in w.server.state.toolTip()
    assert w.server.state.text().startswith("Not running")
    assert plain in w.server.log_view.toPlainText()  # the failure is in the request log
    for i in range(w.tabs.count()):
        w.tabs.setCurrentIndex(i)
        qtbot.wait(20)
        assert w.splitter.sizes() == sizes


# -- 3. The red error banner hides the tab bar and the top of the desk ----------------------
def _rect_in(w, widget):
    from PySide6.QtCore import QRect

    return QRect(widget.mapTo(w, widget.rect().topLeft()), widget.size())


def test_an_error_banner_covers_no_control(loaded, qtbot, styled):
    from PySide6.QtWidgets import QAbstractButton, QComboBox, QTabBar

    w = loaded
    w.resize(1024, 700)
    qtbot.wait(50)
    size = w.size()
    w.show_error("Model not loaded: " + "a long reason that wraps " * 12)
    qtbot.wait(50)
    assert w.banner.isVisible() and w.size() == size
    banner = _rect_in(w, w.banner)
    controls = [
        c
        for kind in (QAbstractButton, QComboBox, QTabBar)
        for c in w.centralWidget().findChildren(kind)
        if c.isVisible() and not w.banner.isAncestorOf(c)
    ]
    assert w.mixer.bypass in controls and w.tabs.tabBar() in controls
    covered = [c for c in controls if banner.intersects(_rect_in(w, c))]
    assert covered == []
    assert w.banner.geometry().top() >= w.model_bar.geometry().bottom()  # under the bar
    w.bridge.model_loaded.emit(ModelLoaded(dict(LONG_INFO)))  # the next action succeeds
    qtbot.wait(50)
    assert not w.banner.isVisible()


# -- 4. Keyboard focus is invisible on M/S and the faders ------------------------------------
def _focus_changes_pixels(w, qtbot, widget) -> bool:
    """The widget drawn with keyboard focus differs from it drawn without."""
    w.mixer.bypass.setFocus(Qt.TabFocusReason)  # focus somewhere else first
    qtbot.waitUntil(lambda: w.mixer.bypass.hasFocus(), timeout=2000)
    plain = widget.grab().toImage()
    widget.setFocus(Qt.TabFocusReason)
    qtbot.waitUntil(widget.hasFocus, timeout=2000)
    focused = widget.grab().toImage()
    return plain != focused


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_keyboard_focus_is_visible_on_the_strip_controls(loaded, qtbot, mode):
    w = loaded
    w.theme_actions[mode].trigger()
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=2000)
    w.tabs.setCurrentIndex(3)  # Server, for its checkbox
    strip = w.mixer.strips[w.ids["lora_attn"]]
    strip.on.setChecked(False)  # a muted M is lit: the ring must show on it too
    unseen = [
        name
        for name, widget in (
            ("mute", strip.on),
            ("solo", strip.solo),
            ("fader", strip.slider),
            ("scale box", strip.spin),
            ("Zero all", w.mixer.zero_btn),
            ("preset box", w.mixer.preset_box),
            ("HTTP checkbox", w.server.allow_lora),
        )
        if not _focus_changes_pixels(w, qtbot, widget)
    ]
    assert unseen == []


def test_the_window_starts_with_the_focus_in_the_message_box(window, qtbot):
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=2000)
    assert window.focusWidget() is window.chat.input


# -- 5. Mix undo is hard to reach --------------------------------------------------------------
def test_the_edit_menu_names_each_mix_step_and_redo(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.spin.setValue(0.8)
    assert w.undo_action.text() == "&Undo lora_attn 0.00 → 0.80"
    s.on.setChecked(False)
    assert w.undo_action.text() == "&Undo mute lora_attn"
    assert not w.redo_action.isEnabled()
    w.undo_action.trigger()
    assert not s.muted and w.redo_action.text() == "&Redo mute lora_attn"
    assert w.undo_action.text() == "&Undo lora_attn 0.00 → 0.80"
    w.undo_action.trigger()
    assert s.value == 0.0 and not w.undo_action.isEnabled()
    w.redo_action.trigger()
    assert s.value == pytest.approx(0.8)
    edit = [a.text() for a in w.menuBar().actions()]
    assert "&Edit" in edit


def test_the_history_jumps_back_to_any_mix_step(loaded):
    w = loaded
    a, f = (w.mixer.strips[w.ids[n]] for n in ("lora_attn", "lora_ffn"))
    a.spin.setValue(0.5)
    f.spin.setValue(-0.3)
    w.mixer.bypass.setChecked(True)
    steps = w.mixer.history()  # oldest first, with where the desk is now
    assert [label for label, _ in steps] == [
        "start",
        "lora_attn 0.00 → 0.50",
        "lora_ffn 0.00 → -0.30",
        "Bypass all on",
    ]
    assert [now for _, now in steps] == [False, False, False, True]
    w.mixer.jump_to(1)  # just after the first step
    assert a.value == pytest.approx(0.5) and f.value == 0.0 and not w.mixer.bypass.isChecked()
    assert [now for _, now in w.mixer.history()] == [False, True, False, False]
    w.mixer.jump_to(3)  # forward again, through the redo steps
    assert f.value == pytest.approx(-0.3) and w.mixer.bypass.isChecked()
    w.history_menu.aboutToShow.emit()  # the Edit menu's History lists the same steps
    items = [x.text() for x in w.history_menu.actions()]
    assert items == ["start", "lora_attn 0.00 → 0.50", "lora_ffn 0.00 → -0.30", "Bypass all on"]
    w.history_menu.actions()[0].trigger()
    assert a.value == 0.0 and f.value == 0.0 and not w.mixer.bypass.isChecked()


def test_ctrl_z_in_an_empty_chat_box_undoes_the_mix(loaded, qtbot):
    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.spin.setValue(0.6)
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=2000)
    box = w.chat.input
    box.setFocus()
    qtbot.waitUntil(box.hasFocus, timeout=2000)
    qtbot.keyClick(box, Qt.Key_Z, Qt.ControlModifier)  # nothing typed: the mix's undo
    assert s.value == 0.0
    qtbot.keyClicks(box, "hi")
    s.spin.setValue(0.4)
    box.setFocus()
    qtbot.keyClick(box, Qt.Key_Z, Qt.ControlModifier)  # the box's own undo comes first
    assert box.toPlainText() == "" and s.value == pytest.approx(0.4)
    qtbot.keyClick(box, Qt.Key_Z, Qt.ControlModifier)  # now it has none left
    assert s.value == 0.0


# -- 6. The A/B "(current desk mix)" caption goes stale ---------------------------------------
def test_the_ab_caption_of_the_current_desk_follows_the_desk(loaded, qtbot):
    from ui.compare import CURRENT

    w, aid = loaded, loaded.ids["lora_attn"]
    w.compare.set_presets(CURRENT, CURRENT)
    assert "base model" in w.compare.a.mix_label.text()
    w.mixer.strips[aid].spin.setValue(0.8)
    assert "lora_attn ×0.80" in w.compare.a.mix_label.text()
    w.engine.set_mix({aid: 0.3}, source="http")  # set from outside, as the API does
    qtbot.waitUntil(lambda: "lora_attn ×0.30" in w.compare.b.mix_label.text(), timeout=5000)


# -- 7. The ±1 detent is about 3 px wide ---------------------------------------------------------
@pytest.mark.parametrize("target", [1.0, -1.0, 0.0])
def test_the_detents_catch_a_drag_a_few_pixels_off(loaded, qtbot, target):
    from test_mixer_desk import fader_x

    w, aid = loaded, loaded.ids["lora_attn"]
    s = w.mixer.strips[aid]
    s.slider.setFixedWidth(160)  # a roomy desk: pixels are finer than at 100 px
    qtbot.wait(20)
    y = s.slider.height() // 2
    for off in (-5, -3, 3, 5):  # a normal drag lands a few pixels off
        s.spin.setValue(0.5 if target != 0.5 else -0.5)
        start = fader_x(s.slider, s.value)
        qtbot.mousePress(s.slider, Qt.LeftButton, pos=QPoint(start, y))
        x = fader_x(s.slider, target) + off
        qtbot.mouseMove(s.slider, QPoint(x, y))
        qtbot.mouseRelease(s.slider, Qt.LeftButton, pos=QPoint(x, y))
        assert s.value == target, (off, s.value)
    # beyond the catch the fader moves freely
    s.spin.setValue(0.5)
    qtbot.mousePress(s.slider, Qt.LeftButton, pos=QPoint(fader_x(s.slider, 0.5), y))
    x = fader_x(s.slider, target) + 12
    qtbot.mouseMove(s.slider, QPoint(x, y))
    qtbot.mouseRelease(s.slider, Qt.LeftButton, pos=QPoint(x, y))
    assert s.value != target


def test_the_detent_comment_speaks_of_the_real_fader():
    import ui.strip as mixer  # the fader moved there with the Strip class

    src = open(mixer.__file__, encoding="utf-8").read()
    line = next(ln for ln in src.splitlines() if ln.startswith("DETENT_"))
    assert "200 px" not in line


# -- 8. Two RAM figures for one model -----------------------------------------------------------
def _ram_shown(w) -> str:
    part = next(p for p in w.model_bar.info.full_text.split("  ·  ") if p.endswith(" RAM"))
    return part.removesuffix(" RAM")


def test_the_model_bar_and_get_a_model_give_one_ram_figure(loaded):
    from test_get_model import _row

    from core import catalog
    from ui.get_model import GetModelDialog
    from ui.util import human_bytes

    w = loaded
    w.model_bar.show_info(w.engine.model_info())
    dlg = w.model_bar.get_model()
    assert _row(dlg, "smollm2-135m")["RAM needed"] == _ram_shown(w)
    dlg.close()
    from core.model.kv_cache import ram_bytes  # the one formula

    # at the model's own context (the window's default: no -c), each model's own
    own = GetModelDialog(0)
    info = w.engine.model_info()
    at_train = ram_bytes(
        info["memory_bytes"],
        info["n_layers"],
        info["n_kv_heads"],
        info["head_dim"],
        info["n_ctx_train"],
    )
    assert _row(own, "smollm2-135m")["RAM needed"] == human_bytes(at_train)
    assert catalog.find("smollm2-135m").n_ctx_train == info["n_ctx_train"]
    own.close()
    tip = w.model_bar.info.toolTip()
    assert "weights" in tip and "KV cache" in tip  # it says what it counts


# -- 9. Host and Port stay editable while the server runs -------------------------------------
def test_the_fields_that_apply_at_start_are_locked_while_the_server_runs(loaded, qloop, qtbot):
    from test_http_sync import free_port

    w = loaded
    fields = (w.server.host, w.server.port, w.server.api_key, w.server.allow_lora)
    assert all(f.isEnabled() for f in fields)
    w.server.host.setText("127.0.0.1")
    w.server.port.setValue(free_port())
    assert _start_server(w, qtbot)
    assert not any(f.isEnabled() for f in fields)
    assert all("Stop the server" in f.toolTip() for f in fields)
    import asyncio

    fut = asyncio.ensure_future(w.server.stop(remember=False))
    qtbot.waitUntil(fut.done, timeout=10000)
    assert all(f.isEnabled() for f in fields)
    assert not any("Stop the server" in f.toolTip() for f in fields)


# -- 10. At 1024×700 ------------------------------------------------------------------------------
def test_at_1024_the_model_bar_keeps_ram_and_load_time(window, qtbot, styled):
    w = window
    w.resize(1024, 700)
    info = dict(LONG_INFO, ram_bytes=600 * 2**20, kv_bytes=60 * 2**20)
    w.model_bar.show_info(info)
    qtbot.wait(50)
    shown = w.model_bar.info.text()
    assert "600.0 MiB RAM" in shown and "loaded in 1.23 s" in shown, shown
    assert "…" not in shown  # whole facts dropped, none cut in the middle
    tip = w.model_bar.info.toolTip()
    assert "llama" in tip and "ctx 4096/8192" in tip  # the ones left out are in the tooltip
    w.resize(1400, 800)
    qtbot.wait(50)
    assert "llama" in w.model_bar.info.text()  # room again: every fact


def test_a_grid_card_title_elides_with_its_whole_text_in_the_tooltip(loaded, qtbot, styled):
    from core import grid as G
    from core.lora.mix import Mix
    from ui.grid import Card

    w = loaded
    long = "a_rather_long_adapter_name_indeed ×0.75"
    cell = G.Cell(0, 0, 0, Mix({}), w.sampling.params(), long, "seed 123456789")
    card = Card(cell, "base model (no adapters)")
    card.resize(180, 220)
    card.show()
    qtbot.wait(50)
    assert card.minimumSizeHint().width() <= 200  # the title does not widen the card
    assert card.title.text().endswith("…")
    assert card.title.toolTip() == f"{long} · seed 123456789"
    card.close()


# -- 11. Dark theme: a faint checkbox, tiny ‹ › ----------------------------------------------------
def _max_contrast(image, x0, x1, background) -> float:
    from ui.theme import contrast

    best = 0.0
    for x in range(x0, min(x1, image.width())):
        for y in range(image.height()):
            best = max(best, contrast(image.pixelColor(x, y), background))
    return best


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_the_http_checkbox_box_is_visible(window, qtbot, mode):
    from ui import theme as T

    w = window
    w.theme_actions[mode].trigger()
    w.tabs.setCurrentIndex(3)
    qtbot.wait(20)
    box = w.server.allow_lora
    box.setChecked(False)
    image = box.grab().toImage()
    bg = (T.DARK if mode == "dark" else T.LIGHT).window
    # the square alone (its first ~20 px): its edge stands out as a control's must (3:1)
    assert _max_contrast(image, 0, 20, bg) >= 3.0


def _anchor_extent(view, href_prefix):
    """(width, height) in px of the region where the transcript's link answers clicks."""
    vp = view.viewport()
    pts = [
        (x, y)
        for y in range(vp.height())
        for x in range(vp.width())
        if view.anchorAt(QPoint(x, y)).startswith(href_prefix)
    ]
    assert pts, f"no {href_prefix} link shown"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return max(xs) - min(xs) + 1, max(ys) - min(ys) + 1


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_the_version_arrows_are_buttons_of_at_least_20_px(window, qtbot, mode):
    from PySide6.QtGui import QColor

    from ui import theme as T

    w = window
    w.theme_actions[mode].trigger()
    w.resize(1280, 800)
    w.tabs.setCurrentIndex(0)
    meta = {"tokens": 3, "tps": 2.0, "mix": "m", "stop": "eos"}
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "two",
            "meta": meta,
            "version": 1,
            "versions": [
                {"content": "one", "meta": meta},
                {"content": "two", "meta": meta},
                {"content": "three", "meta": meta},
            ],
        },
    ]
    w.chat.render()
    qtbot.wait(50)
    for prefix in ("ver:1:-1", "ver:1:1"):
        width, height = _anchor_extent(w.chat.view, prefix)
        assert width >= 20 and height >= 20, (prefix, width, height)
    html = w.chat.view.toHtml()
    theme = T.DARK if mode == "dark" else T.LIGHT
    # the arrows are drawn in the text colour on a button face, readable in either theme
    assert QColor(theme.text).name() in html.lower()


# -- 12. Grid exports ------------------------------------------------------------------------------
@pytest.fixture
def ran_grid(loaded, qtbot, greedy):
    """A 2-cell grid run with a random seed (seed -1 in the sampling form)."""
    w = loaded
    greedy(w, n_predict=3)
    w.sampling.set_values({"seed": -1, "temperature": 0.7})
    g = w.grid
    w.tabs.setCurrentIndex(w.tabs.indexOf(g.parentWidget()))
    g.x.set_axis("scale", "0, 1", adapter=w.ids["lora_attn"])
    g.y.set_axis(None, "")
    with qtbot.waitSignal(g.finished, timeout=120000):
        assert g.run("Name a colour.")
    return w


def test_the_grid_csv_records_the_seed_each_cell_used(ran_grid, tmp_path):
    import csv

    from core.grid import MAX_SEED

    g = ran_grid.grid
    rows = list(csv.DictReader(open(g.export("csv", tmp_path / "g.csv"), encoding="utf-8")))
    assert len(rows) == 2
    seeds = [r["seed"] for r in rows]
    assert all(s.isdigit() and 0 <= int(s) <= MAX_SEED for s in seeds), seeds
    # the seed is the one the cell ran with: run again with it, the same reply
    assert [int(s) for s in seeds] == [c.cell.params.seed for c in g.cards]


def test_the_grid_png_has_the_prompt_and_settings_and_no_buttons(ran_grid, tmp_path):
    from PySide6.QtGui import QImage
    from PySide6.QtWidgets import QAbstractButton, QLabel

    g = ran_grid.grid
    view = g.export_view()  # what the PNG draws
    assert view.findChildren(QAbstractButton) == []  # no "Use this mix"
    text = "\n".join(label.text() for label in view.findChildren(QLabel))
    assert "Name a colour." in text
    assert "temperature 0.70" in text and "max tokens 3" in text
    assert all(c.done.content.strip()[:10] in text for c in g.cards)  # the replies
    image = QImage(str(g.export("png", tmp_path / "g.png")))
    assert (image.width(), image.height()) == (view.width(), view.height())
    assert all(c.use.isVisible() for c in g.cards)  # the tab itself keeps its buttons


# -- 13. Small ones ----------------------------------------------------------------------------------
def test_the_selected_preset_is_restored_after_a_restart(loaded, make_window):
    w = loaded
    w.mixer.save_preset("warm")
    w.mixer.save_preset("cold")
    w.mixer.preset_box.setCurrentText("warm")
    w.close()
    w2 = make_window()
    assert w2.mixer.preset_box.currentText() == "warm"
    assert w2.mixer.rename_action.isEnabled()


def _long_chat(n: int = 30) -> list[dict]:
    meta = {"tokens": 3, "tps": 2.0, "mix": "m", "stop": "eos"}
    out = []
    for i in range(n):
        out.append({"role": "user", "content": f"question {i}"})
        out.append({"role": "assistant", "content": f"answer {i}\n\n" + "text " * 60, "meta": meta})
    return out


def test_the_chat_reopens_at_the_last_message(window, make_window, qtbot):
    w = window
    w.chat.conversation["messages"] = _long_chat()
    w.chat._save()
    w.close()
    w2 = make_window()
    w2.resize(1280, 800)
    sb = w2.chat.view.verticalScrollBar()
    qtbot.waitUntil(lambda: sb.maximum() > 0, timeout=3000)
    qtbot.wait(100)
    assert sb.value() == sb.maximum()


def test_a_theme_switch_keeps_the_scroll_position(window, qtbot, styled):
    from PySide6.QtWidgets import QAbstractSlider

    w = window
    w.resize(1024, 700)
    w.chat.conversation["messages"] = _long_chat()
    w.chat.render()
    view, sb = w.chat.view, w.chat.view.verticalScrollBar()
    qtbot.waitUntil(lambda: sb.maximum() > 0, timeout=3000)
    qtbot.wait(100)
    for frac in (0.3, 0.9):  # the text at the top of the view stays there
        sb.setValue(int(sb.maximum() * frac))
        sb.triggerAction(QAbstractSlider.SliderSingleStepAdd)  # as the reader scrolls
        qtbot.wait(50)
        top = view.cursorForPosition(QPoint(5, 5)).position()
        for mode in ("dark", "light"):
            w.theme_actions[mode].trigger()
            qtbot.wait(200)
            assert abs(view.cursorForPosition(QPoint(5, 5)).position() - top) < 40, (frac, mode)


def test_the_diff_tooltip_label_does_not_repeat_itself():
    from core.lora.mix import Mix
    from ui.compare import BASE, CURRENT, side_label

    names = {0: "pirate"}
    assert side_label("A", BASE, Mix({0: 0.0}), names) == "A · base model (no adapters)"
    assert side_label("B", CURRENT, Mix({0: 0.5}), names) == "B · the desk: pirate ×0.50"
    assert side_label("B", "warm", Mix({0: 0.5}), names) == "B · warm: pirate ×0.50"


def test_the_effective_column_explains_alpha_over_rank(loaded):
    m = loaded.mixer
    header = next(h for h in m.headers if h.text() == "Effective")
    assert "α / r" in header.toolTip()
    with_alpha = [s for s in m.strips.values() if s.info.get("alpha")]
    assert with_alpha
    for s in with_alpha:
        a, r = s.info["alpha"], s.info["rank"]
        s.spin.setValue(0.5)
        assert f"α/r = {a:g}/{r} = {a / r:g}" in s.eff.toolTip()
