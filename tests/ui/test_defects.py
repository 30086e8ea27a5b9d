"""Defects a new user met on the real window (issue #17), each reproduced first."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QItemSelectionModel, Qt

from core.serve.events import ModelLoaded, ModelLoading


def test_removing_several_selected_rows_removes_them_all(loaded, qtbot, tmp_path):
    w = loaded
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a gguf at all")
    w.adapters.add_paths([bad])
    qtbot.waitUntil(lambda: len(w.adapters.errors) == 1, timeout=5000)
    errors = []
    w.bridge.error.connect(errors.append)
    tree = w.adapters.tree
    keep = w.ids["lora_ffn"]
    for i in range(tree.topLevelItemCount()):
        item = tree.topLevelItem(i)
        if item.data(0, Qt.UserRole) != keep:
            tree.selectionModel().select(
                tree.indexFromItem(item), QItemSelectionModel.Select | QItemSelectionModel.Rows
            )
    assert len(tree.selectedItems()) == 3  # two adapters and the red row
    w.adapters.remove_selected()
    assert [a["id"] for a in w.engine.adapters()] == [keep]
    assert w.adapters.errors == {}
    assert tree.topLevelItemCount() == 1 and errors == []
    qtbot.waitUntil(lambda: list(w.mixer.strips) == [keep], timeout=5000)


def test_html_in_a_message_is_shown_as_text(window):
    w = window
    conv = w.chat.conversation
    conv["messages"] = [
        {"role": "user", "content": '<font color="red">x</font> and <img src="y.png">'},
        {
            "role": "assistant",
            "content": "<b>bold?</b> <script>no</script>",
            "meta": {"tokens": 3, "tps": 2.0, "mix": "m", "stop": "eos"},
        },
    ]
    w.chat.render()
    text = w.chat.view.toPlainText()
    assert '<font color="red">x</font>' in text and '<img src="y.png">' in text
    assert "Assistant" in text and "<b>bold?</b> <script>no</script>" in text
    assert "3 tokens" in text  # the meta line after the <img> is still there
    html = w.chat.view.toHtml()
    assert "color:#ff0000" not in html.replace(" ", "").lower()
    assert "<img" not in html


LONG_INFO = {
    "name": "SmolLM2-135M-Instruct-with-a-rather-long-file-name-Q8_0",
    "path": "/models/SmolLM2-135M-Instruct-with-a-rather-long-file-name-Q8_0.gguf",
    "arch": "llama",
    "n_params": 134_515_008,
    "quant": "Q8_0",
    "n_ctx": 4096,
    "n_ctx_train": 8192,
    "memory_bytes": 540_000_000,
    "load_ms": 1234,
}


@pytest.fixture
def styled(qapp):
    """The real window's style and stylesheet (sizes depend on them)."""
    from ui.app import load_stylesheet

    old = qapp.styleSheet()
    qapp.setStyleSheet(load_stylesheet())
    yield
    qapp.setStyleSheet(old)


def _settle(qtbot):
    qtbot.wait(50)


def test_the_window_does_not_grow_by_itself(window, qtbot, styled):
    w = window
    w.resize(1024, 700)
    _settle(qtbot)
    size = w.size()
    w.model_bar.show_info(LONG_INFO)
    w.bridge.model_loading.emit(
        ModelLoading("m.gguf", 0.4, "reading tensors from the cache file")
    )  # progress + Cancel
    _settle(qtbot)
    assert w.size() == size
    w.chat.conversation["messages"] = [{"role": "user", "content": "hi"}]
    w.chat.render()
    w.chat.edit_message(0)  # the "✎ edit" banner
    _settle(qtbot)
    assert w.size() == size
    assert w.minimumSizeHint().width() <= 1024 and w.minimumSizeHint().height() <= 700


def test_an_error_banner_sits_above_the_desk_and_goes_after_a_success(window, qtbot):
    """Issue #36 turned #17's overlay into room in the layout: the banner pushes the
    desk down (it covered the tab bar and the top of the desk) and the window keeps
    its size."""
    w = window
    w.resize(1100, 760)
    _settle(qtbot)
    size = w.size()
    w.show_error("Model not loaded: " + "a long reason that wraps " * 12)
    _settle(qtbot)
    assert w.banner.isVisible() and w.size() == size
    assert w.banner.geometry().top() >= w.model_bar.geometry().bottom()  # under the bar
    assert w.splitter.geometry().top() >= w.banner.geometry().bottom()  # the desk below it
    w.bridge.model_loaded.emit(ModelLoaded(dict(LONG_INFO)))  # the next action succeeds
    _settle(qtbot)
    assert not w.banner.isVisible()


def test_first_start_fits_the_screen():
    from PySide6.QtCore import QSize

    from ui.main_window import initial_size

    for screen in (QSize(1280, 800), QSize(1280, 770), QSize(1024, 700), QSize(2560, 1440)):
        got = initial_size(screen)
        assert got.width() <= screen.width() and got.height() <= screen.height() - 30
        assert got.width() >= min(1024, screen.width()) - 60


def test_at_1024x700_send_stop_regenerate_and_status_bar_are_visible(loaded, qtbot, styled):
    w = loaded
    w.settings.set("window_geometry", None)
    w.resize(1024, 700)
    w.status("ready")
    _settle(qtbot)
    assert w.size().width() == 1024 and w.size().height() == 700
    inside = w.rect()
    for b in (w.chat.send_btn, w.chat.stop_btn, w.chat.regen_btn, w.statusBar()):
        assert b.isVisible()
        r = b.rect().translated(b.mapTo(w, b.rect().topLeft()))
        assert inside.contains(r), (b, r, inside)
        assert r.width() >= b.minimumSizeHint().width() - 1  # not squeezed
    for s in w.mixer.strips.values():
        r = s.spin.rect().translated(s.spin.mapTo(w, s.spin.rect().topLeft()))
        assert inside.contains(r)


def test_bypass_all_keeps_its_font_weight_when_checked():
    """A checked state that made the text bolder no longer fit the button's width
    (computed unchecked): "Bypass all" showed as "3ypass al"."""
    import re

    from ui.app import load_stylesheet

    qss = load_stylesheet()
    checked = re.search(r"#bypassButton:checked\s*\{([^}]*)\}", qss).group(1)
    assert "font-weight" not in checked and "font-size" not in checked


def test_menus_have_a_visible_frame():
    import re

    from ui.app import load_stylesheet

    qss = load_stylesheet()
    rule = re.search(r"(?m)^QMenu\s*\{([^}]*)\}", qss)
    assert rule and "border:" in rule.group(1) and "#ffffff" in rule.group(1)


def test_system_prompt_survives_a_restart_with_the_last_chat(window, make_window):
    w = window
    w.chat.conversation["messages"] = [{"role": "user", "content": "hi"}]
    w.chat._save()  # saved with an empty system prompt
    w.sampling.system_prompt.setPlainText("You are terse.")  # written after
    w.close()
    w2 = make_window()
    assert w2.chat.conversation["id"] == w.chat.conversation["id"]
    assert w2.sampling.system_prompt.toPlainText() == "You are terse."


def _restart_with_desk(make_window, qtbot, w):
    """Close ``w``, empty the engine as a fresh start would, open a new window and
    restore the saved desk the way ui.app.create_window does."""
    w.close()
    for a in w.engine.adapters():
        w.engine.remove_adapter(a["id"])
    w2 = make_window()
    for path, scale in w2.restore_desk():
        w2.bridge.add_adapter(path, scale)
    return w2


def test_the_desk_is_restored_at_start(loaded, make_window, qtbot, tmp_path):
    w, ids = loaded, loaded.ids
    w.mixer.strips[ids["lora_attn"]].spin.setValue(0.25)
    w.mixer.strips[ids["lora_ffn"]].spin.setValue(-1.5)
    w.mixer.strips[ids["lora_ffn"]].on.setChecked(False)  # muted
    w.mixer.strips[ids["lora_all_q8"]].solo.setChecked(True)
    w.mixer.strips[ids["lora_all_q8"]].spin.setValue(0.5)
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"GGUF but not really")
    desk = w.settings.get("desk")
    desk["adapters"].append({"path": str(gone), "scale": 1.0, "muted": False, "solo": False})
    w.settings.set("desk", desk)  # an adapter that no longer loads

    w2 = _restart_with_desk(make_window, qtbot, w)
    qtbot.waitUntil(lambda: len(w2.mixer.strips) == 3, timeout=10000)
    qtbot.waitUntil(lambda: len(w2.adapters.errors) == 1, timeout=10000)
    by_name = {s.info["name"]: s for s in w2.mixer.strips.values()}
    assert by_name["lora_attn"].value == 0.25
    assert by_name["lora_ffn"].value == -1.5 and by_name["lora_ffn"].muted
    assert by_name["lora_all_q8"].solo.isChecked() and by_name["lora_all_q8"].value == 0.5
    mix = w2.engine.get_mix()
    assert mix[by_name["lora_all_q8"].id] == 0.5  # solo: only it sounds
    assert mix[by_name["lora_attn"].id] == 0.0 and mix[by_name["lora_ffn"].id] == 0.0
    assert str(gone) in w2.adapters.errors  # a red row with the reason


def test_reopening_the_model_keeps_the_desk_and_the_ids(loaded, qtbot, smollm_path):
    w, ids = loaded, loaded.ids
    w.mixer.strips[ids["lora_attn"]].spin.setValue(0.75)
    w.mixer.strips[ids["lora_ffn"]].on.setChecked(False)
    said = []
    w.statusBar().messageChanged.connect(said.append)
    with qtbot.waitSignal(w.bridge.model_loaded, timeout=120000):
        w.open_model(str(smollm_path))  # e.g. the same file from Recent
    assert any("3 adapter(s) on the desk stay loaded" in m for m in said)  # said before
    qtbot.wait(200)  # the events that follow model_loaded
    assert {a["name"]: a["id"] for a in w.engine.adapters()} == ids  # ids do not count on
    assert sorted(w.mixer.strips) == sorted(ids.values())
    assert w.mixer.strips[ids["lora_attn"]].value == 0.75
    assert w.mixer.strips[ids["lora_ffn"]].muted
    assert w.engine.get_mix()[ids["lora_attn"]] == 0.75
    assert w.adapters.errors == {}


def test_an_adapter_that_no_longer_loads_becomes_a_red_row_on_reload(
    window, qtbot, smollm_path, ref_dir, tmp_path
):
    import shutil

    w = window
    copy = tmp_path / "moved.gguf"
    shutil.copy(ref_dir / "adapters" / "lora_attn.gguf", copy)
    w.adapters.add_paths([ref_dir / "adapters" / "lora_ffn.gguf", copy])
    qtbot.waitUntil(lambda: len(w.mixer.strips) == 2, timeout=10000)
    ids = {a["name"]: a["id"] for a in w.engine.adapters()}
    copy.unlink()  # the file went away while the desk was open
    with qtbot.waitSignal(w.bridge.model_loaded, timeout=120000):
        w.open_model(str(smollm_path))
    qtbot.waitUntil(lambda: str(copy) in w.adapters.errors, timeout=10000)
    assert "no such file" in w.adapters.errors[str(copy)]
    assert [a["id"] for a in w.engine.adapters()] == [ids["lora_ffn"]]
    assert list(w.mixer.strips) == [ids["lora_ffn"]]
    assert "moved.gguf" in w.banner.label.text()


def test_one_token_and_one_rounding_of_tok_s(window):
    w = window
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x", "meta": {"tokens": 1, "tps": 26.25}},
    ]
    w.chat.render()
    text = w.chat.view.toPlainText()
    assert "1 token ·" in text and "1 tokens" not in text


def test_adapter_size_is_the_file_size_in_mib(loaded, ref_dir):
    w = loaded
    tree = w.adapters.tree
    rows = {tree.topLevelItem(i).text(0): tree.topLevelItem(i) for i in range(3)}
    for name in ("lora_all_q8", "lora_attn"):
        size = (ref_dir / "adapters" / f"{name}.gguf").stat().st_size
        mib = size / 2**20
        want = f"{mib:.2f} MiB" if mib < 10 else f"{mib:.1f} MiB"
        assert rows[name].text(3) == want
    # q8 on disk is not what float32 takes in memory: that is in the tooltip
    q8 = w.engine.adapter(w.ids["lora_all_q8"])
    assert q8.nbytes > (ref_dir / "adapters" / "lora_all_q8.gguf").stat().st_size
    assert "in memory" in rows["lora_all_q8"].toolTip(3)


def test_error_texts_name_the_file_once(window, qtbot, tmp_path):
    w = window
    notes = tmp_path / "notes.txt"
    notes.write_text("shopping list")
    w.adapters.add_paths([notes])
    qtbot.waitUntil(lambda: str(notes) in w.adapters.errors, timeout=5000)
    banner = w.banner.label.text()
    assert banner.startswith("Adapter not loaded: notes.txt is not a valid GGUF file")
    assert banner.count("notes.txt") == 1 and "adapter notes" not in banner.lower()
    row = w.adapters.tree.topLevelItem(0)
    assert row.text(0) == "notes.txt" and row.text(5).count("notes.txt") <= 1


def test_a_model_added_as_an_adapter_offers_to_open_it_as_the_model(loaded, qtbot, smollm_path):
    w = loaded
    w.adapters.add_paths([smollm_path])
    box = w.adapters.model_prompt
    qtbot.waitUntil(box.isVisible, timeout=5000)
    assert "model file, not a LoRA adapter" in box.text()
    assert w.adapters.errors == {}  # no red row for it
    with qtbot.waitSignal(w.bridge.model_loaded, timeout=120000):
        box.open_btn.click()
    assert w.engine.path == smollm_path
    assert {a["name"]: a["id"] for a in w.engine.adapters()} == w.ids


def test_the_desks_control_vectors_are_restored_at_start(
    loaded, make_window, qtbot, tmp_path, ref_dir
):
    """A control vector on the desk (made in the app, or loaded) comes back at the next
    start with its fader and buttons, once the model has loaded; one whose file is gone
    is said in the status line and left off the desk (#37)."""
    from core.serve.events import ModelLoaded

    w = loaded
    src = ref_dir / "control_vectors" / "cv_a.gguf"
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(src.read_bytes())
    w.engine.add_control_vector(mine, 0.0)
    qtbot.waitUntil(lambda: len(w.mixer.strips) == 4, timeout=10000)
    vec = next(s for s in w.mixer.strips.values() if s.info.get("path") == str(mine))
    vec.spin.setValue(0.7)
    vec.on.setChecked(False)  # muted
    desk = w.settings.get("desk")
    assert [(e["path"], e["scale"], e["muted"]) for e in desk["vectors"]] == [
        (str(mine), 0.7, True)
    ]
    gone = tmp_path / "gone.gguf"
    desk["vectors"].append({"path": str(gone), "scale": 1.0, "muted": False, "solo": False})
    w.settings.set("desk", desk)
    w.close()
    for v in w.engine.control_vectors():  # a fresh start has none
        w.engine.remove_control_vector(v["id"])

    w2 = _restart_with_desk(make_window, qtbot, w)
    qtbot.waitUntil(lambda: len(w2.mixer.strips) == 3, timeout=10000)
    w2.bridge.model_loaded.emit(ModelLoaded(info=w2.engine.model_info()))  # as at start
    qtbot.waitUntil(lambda: len(w2.mixer.strips) == 4, timeout=10000)
    back = next(s for s in w2.mixer.strips.values() if s.info.get("path") == str(mine))
    assert back.value == 0.7 and back.muted
    assert [v["path"] for v in w2.engine.control_vectors()] == [str(mine)]
    qtbot.waitUntil(lambda: "gone.gguf" in w2.statusBar().currentMessage(), timeout=5000)
    saved = w2.settings.get("desk")["vectors"]
    assert [e["path"] for e in saved] == [str(mine)]  # the gone one is off the desk
