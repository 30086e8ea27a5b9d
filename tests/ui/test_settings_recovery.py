"""Hostile settings, presets and chats written into MIXDESK_HOME: the window opens,
the bad field alone is back to its default, the rest is kept, and a file that
could not be read is moved aside (never overwritten) and named in the banner."""

from __future__ import annotations

import json
import os

import pytest

from core.paths import config_dir, data_dir

GOOD = {
    "server": {"host": "127.0.0.2", "port": 18124, "api_key": "keep-key", "enabled": False},
    "sampling": {"temperature": 0.3, "top_k": 7, "n_predict": 99, "seed": 5},
    "system_prompt": "Be kind.",
    "recent_models": ["/models/kept.gguf"],
}


def _settings_with(**changes) -> dict:
    data = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        target = data
        for key in path:
            target = target[key]
        target[last] = value
    return data


def _write_settings(data) -> None:
    (config_dir() / "settings.json").write_text(json.dumps(data))


def _kept_apart_from(w, field: str) -> None:
    """Every GOOD field except ``field`` (and its parent group) is what was saved."""
    s = w.sampling.values()
    if field != "sampling__temperature":
        if not field.startswith("sampling"):
            assert s["temperature"] == 0.3
    if not field.startswith("sampling"):
        assert s["top_k"] == 7 and s["n_predict"] == 99 and s["seed"] == 5
    if not field.startswith("server"):
        assert w.server.port.value() == 18124 and w.server.host.text() == "127.0.0.2"
    if field != "system_prompt":
        assert w.sampling.system_prompt.toPlainText() == "Be kind."
    if field != "recent_models":
        assert w.settings.recent_models() == ["/models/kept.gguf"]


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("server", "localhost:80", lambda w: w.server.port.value() == 8080),
        ("server__host", 12, lambda w: w.server.host.text() == "127.0.0.1"),
        (
            "server__port",
            "abc",
            lambda w: w.server.port.value() == 8080 and w.server.host.text() == "127.0.0.2",
        ),
        ("server__port", 70000, lambda w: w.server.port.value() == 8080),
        (
            "server__api_key",
            ["k"],
            lambda w: w.server.api_key.text() == "" and w.server.port.value() == 18124,
        ),
        (
            "sampling__temperature",
            "hot",
            lambda w: (
                w.sampling.values()["temperature"] == 0.7 and w.sampling.values()["top_k"] == 7
            ),
        ),
        ("sampling__top_k", 1e400, lambda w: w.sampling.values()["top_k"] == 40),
        ("sampling", [1, 2], lambda w: w.sampling.values()["top_k"] == 40),
        ("system_prompt", 42, lambda w: w.sampling.system_prompt.toPlainText() == ""),
        ("recent_models", "a.gguf", lambda w: w.settings.recent_models() == []),
        ("last_conversation", "../..", lambda w: w.chat.conversation["messages"] == []),
        ("last_conversation", 7, lambda w: w.chat.conversation["messages"] == []),
        ("window_geometry", 3.5, lambda w: w.isVisible()),
        ("splitter_state", {"x": 1}, lambda w: w.isVisible()),
        ("tab", "chat", lambda w: w.tabs.currentIndex() == 0),
        ("compare", "a", lambda w: w.compare.a.combo.count() > 0),
    ],
)
def test_a_bad_field_alone_falls_back_to_its_default(make_window, field, value, check):
    _write_settings(_settings_with(**{field: value}))
    w = make_window()
    assert check(w)
    _kept_apart_from(w, field)
    assert not w.banner.isVisible()  # the file itself was readable


def _moved_aside(folder, name) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p.startswith(f"{name}.corrupt-"))


@pytest.mark.parametrize("content", ["{ not json", "[1, 2]", b"\xff\xfe{}"])
def test_corrupt_settings_file_is_kept_aside_and_said(make_window, content):
    path = config_dir() / "settings.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    w = make_window()
    kept = _moved_aside(config_dir(), "settings.json")
    assert len(kept) == 1
    assert (config_dir() / kept[0]).read_bytes() == (
        content if isinstance(content, bytes) else content.encode()
    )
    assert w.banner.isVisible()
    assert "settings.json could not be read" in w.banner.label.text()
    assert kept[0] in w.banner.label.text() and "defaults are used" in w.banner.label.text()
    assert w.sampling.values()["n_predict"] == 256
    w.sampling.system_prompt.setPlainText("new")  # saving now writes a fresh file
    assert json.loads(path.read_text())["system_prompt"] == "new"
    assert (config_dir() / kept[0]).exists()


def test_settings_json_that_is_a_folder(make_window):
    (config_dir() / "settings.json").mkdir()
    (config_dir() / "settings.json" / "inside").write_text("x")
    w = make_window()
    kept = _moved_aside(config_dir(), "settings.json")
    assert len(kept) == 1 and (config_dir() / kept[0] / "inside").read_text() == "x"
    assert "settings.json could not be read" in w.banner.label.text()
    w.server.port.setValue(18200)
    assert json.loads((config_dir() / "settings.json").read_text())["server"]["port"] == 18200


def test_corrupt_presets_are_kept_aside_not_overwritten_by_save(make_window):
    presets = config_dir() / "presets.json"
    presets.write_text('{"warm": {"adapters": {}}, oops')
    _write_settings(GOOD)
    w = make_window()
    kept = _moved_aside(config_dir(), "presets.json")
    assert len(kept) == 1
    assert (config_dir() / kept[0]).read_text() == '{"warm": {"adapters": {}}, oops'
    assert "presets.json could not be read" in w.banner.label.text()
    assert w.sampling.system_prompt.toPlainText() == "Be kind."  # settings were fine
    w.mixer.save_preset("fresh")
    assert list(json.loads(presets.read_text())) == ["fresh"]
    assert (config_dir() / kept[0]).read_text().endswith("oops")


def test_a_bad_preset_is_dropped_the_others_kept(make_window):
    (config_dir() / "presets.json").write_text(
        json.dumps(
            {
                "bad": "not a preset",
                "half": {"adapters": {"/a.gguf": {"scale": "loud", "muted": True}}},
                "ok": {"bypass": True, "adapters": {}},
            }
        )
    )
    w = make_window()
    assert w.settings.presets.names() == ["half", "ok"]
    assert w.settings.presets.get("half")["adapters"]["/a.gguf"]["scale"] == 0.0
    assert w.settings.presets.get("half")["adapters"]["/a.gguf"]["muted"] is True
    assert w.mixer.load_preset("half")


def _write_chat(cid: str, conv) -> None:
    folder = data_dir() / "conversations"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{cid}.json").write_text(conv if isinstance(conv, str) else json.dumps(conv))


def test_chat_with_bad_fields_opens_with_the_good_ones(make_window):
    _write_chat(
        "20260101-000000-aaaaaa",
        {
            "id": "../../escape",
            "title": ["no"],
            "updated": "yesterday",
            "system_prompt": 5,
            "messages": [
                {"role": "user", "content": "hello <b>there</b>"},
                {"role": "assistant", "content": 3, "meta": {"tokens": "many", "tps": "fast"}},
                "not a message",
                {"role": "wizard", "content": "x"},
                {"role": "assistant", "content": "fine", "meta": {"tokens": 2, "tps": 1.5}},
            ],
        },
    )
    _write_settings(_settings_with(last_conversation="20260101-000000-aaaaaa"))
    w = make_window()
    conv = w.chat.conversation
    assert conv["id"] == "20260101-000000-aaaaaa"
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "assistant"]
    assert conv["messages"][1]["content"] == "" and conv["messages"][1]["meta"]["tps"] == 0.0
    assert "fine" in w.chat.view.toPlainText()
    w.chat._save()  # saves under its file name, never the id written inside
    assert (data_dir() / "conversations" / "20260101-000000-aaaaaa.json").exists()
    assert not (data_dir() / "escape.json").exists()


def test_chat_whose_messages_are_a_string(make_window):
    _write_chat("20260101-000000-bbbbbb", {"title": "t", "messages": "oops"})
    _write_settings(_settings_with(last_conversation="20260101-000000-bbbbbb"))
    w = make_window()
    assert w.chat.conversation["id"] == "20260101-000000-bbbbbb"
    assert w.chat.conversation["messages"] == []
    assert w.sampling.system_prompt.toPlainText() == "Be kind."


def test_corrupt_chat_is_kept_aside_and_said(make_window):
    _write_chat("20260101-000000-cccccc", '{"messages": [')
    _write_chat("20260101-000000-dddddd", {"title": "good one", "messages": []})
    _write_settings(_settings_with(last_conversation="20260101-000000-cccccc"))
    w = make_window()
    folder = data_dir() / "conversations"
    kept = _moved_aside(folder, "20260101-000000-cccccc.json")
    assert len(kept) == 1 and (folder / kept[0]).read_text() == '{"messages": ['
    assert "20260101-000000-cccccc.json could not be read" in w.banner.label.text()
    titles = w.chat.sidebar.titles()
    assert "good one" in titles
