"""Settings, presets, server settings, geometry and conversations survive a restart
(a new window on the same MIXDESK_HOME), written atomically."""

from __future__ import annotations

import json
import os

from core.settings import Conversations, Settings, atomic_write_json


def test_settings_survive_restart(loaded, make_window, qtbot):
    w, ids = loaded, loaded.ids
    w.sampling.set_values({"temperature": 0.33, "top_k": 7, "n_predict": 99, "seed": 42})
    w.sampling.system_prompt.setPlainText("You are terse.")
    w.server.port.setValue(18123)
    w.server.api_key.setText("sekrit")
    w.server._save()
    w.mixer.strips[ids["lora_attn"]].spin.setValue(0.25)
    w.mixer.save_preset("quarter")
    conv = w.chat.conversation
    conv["messages"] = [
        {"role": "user", "content": "remember me"},
        {
            "role": "assistant",
            "content": "I will",
            "meta": {"tokens": 2, "tps": 1.0, "mix": "x", "stop": "eos"},
        },
    ]
    w.chat._save()
    w.resize(1333, 844)
    w.tabs.setCurrentIndex(2)
    w.settings.add_recent("recent_models", "/models/a.gguf")
    w.close()
    geometry = Settings().get("window_geometry")

    w2 = make_window()
    assert w2.sampling.values()["temperature"] == 0.33
    assert w2.sampling.values()["top_k"] == 7 and w2.sampling.values()["seed"] == 42
    assert w2.sampling.system_prompt.toPlainText() == "You are terse."
    assert w2.server.port.value() == 18123 and w2.server.api_key.text() == "sekrit"
    assert "18123" in w2.server.url.text() and "sekrit" not in w2.server.curl.toPlainText()
    assert "Bearer sekrit" in w2.server.curl_command(reveal=True)  # what Copy curl copies
    assert w2.settings.presets.names() == ["quarter"]
    assert w2.chat.conversation["id"] == conv["id"]
    assert "remember me" in w2.chat.view.toPlainText()
    # the offscreen screen (800x800) clamps sizes, so check the saved geometry round-trips
    from PySide6.QtCore import QByteArray

    assert geometry and w2.restoreGeometry(QByteArray.fromBase64(geometry.encode()))
    assert w2.tabs.currentIndex() == 2
    assert w2.settings.recent_models()[0] == "/models/a.gguf"


def test_atomic_writes_leave_no_partial_files(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_json(target, {"a": 1})
    try:
        atomic_write_json(target, {"bad": object()})  # fails mid-serialisation
    except TypeError:
        pass
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_corrupt_settings_file_is_ignored_not_fatal():
    s = Settings()
    s.path.write_text("{ not json")
    s2 = Settings()
    assert s2.get("sampling")["n_predict"] == 256
    c = Conversations()
    (c.folder / "broken.json").write_text("[")
    assert c.list() == []
