"""core.settings without Qt: the schema checks each field alone, unreadable files are
moved aside (never overwritten), conversation ids are safe file names."""

from __future__ import annotations

import json
import os

import pytest

from core.settings import DEFAULTS, SCHEMA, Conversations, Settings, move_aside


def _write(tmp_path, obj) -> Settings:
    (tmp_path / "settings.json").write_text(json.dumps(obj))
    return Settings(tmp_path)


def test_defaults_come_from_the_schema():
    assert set(DEFAULTS) == set(SCHEMA)
    assert DEFAULTS["server"]["port"] == 8080 and DEFAULTS["server"]["allow_runtime_lora"] is False
    assert DEFAULTS["sampling"]["n_predict"] == 256


@pytest.mark.parametrize(
    "bad, key, expect",
    [
        ({"server": {"port": "abc", "host": "h"}}, "server", {"port": 8080, "host": "h"}),
        ({"server": {"port": True}}, "server", {"port": 8080}),
        ({"server": {"port": 80.5}}, "server", {"port": 8080}),
        ({"server": {"host": "  "}}, "server", {"host": "127.0.0.1"}),
        ({"server": {"enabled": "yes"}}, "server", {"enabled": False}),
        ({"sampling": {"temperature": float("nan"), "top_k": 3}}, "sampling", {"top_k": 3}),
        ({"sampling": {"temperature": -1}}, "sampling", {"temperature": 0.7}),
        ({"sampling": {"seed": 2**40}}, "sampling", {"seed": -1}),
        ({"recent_models": ["/a", 3, None, "/b"]}, "recent_models", ["/a", "/b"]),
        ({"last_conversation": "../x"}, "last_conversation", None),
        ({"last_conversation": ".hidden"}, "last_conversation", None),
        ({"last_conversation": "20260101-000000-abc123"}, "last_conversation", None),
        ({"window_geometry": "not base64!"}, "window_geometry", None),
        ({"desk": {"bypass": 1, "adapters": [{"path": "/a", "scale": 9}, 5]}}, "desk", None),
    ],
)
def test_each_bad_field_takes_its_own_default(tmp_path, bad, key, expect):
    s = _write(tmp_path, {**bad, "system_prompt": "kept"})
    got = s.get(key)
    if key == "last_conversation" and bad[key].startswith("2026"):
        assert got == bad[key]  # a safe id is kept
    elif key == "desk":
        assert got == {
            "bypass": False,
            "adapters": [{"path": "/a", "scale": 0.0, "muted": False, "solo": False}],
            "vectors": [],  # a desk saved before control vectors had strips
            "merge": {"method": "linear"},
        }
    elif isinstance(expect, dict):
        assert {k: got[k] for k in expect} == expect
    else:
        assert got == expect
    assert s.get("system_prompt") == "kept"
    assert s.problems == []


def test_values_set_later_are_checked_on_read_too(tmp_path):
    s = Settings(tmp_path)
    s.set("tab", "two")
    assert s.get("tab") == 0
    s.update("server", port=99999)
    assert s.get("server")["port"] == 8080


def test_unknown_keys_survive_a_round_trip(tmp_path):
    s = _write(tmp_path, {"future_key": {"x": 1}})
    s.set("system_prompt", "p")
    assert json.loads((tmp_path / "settings.json").read_text())["future_key"] == {"x": 1}


def test_unreadable_settings_are_moved_aside_not_overwritten(tmp_path):
    (tmp_path / "settings.json").write_text('{"system_prompt": "precious", ')
    s = Settings(tmp_path)
    kept = [p for p in os.listdir(tmp_path) if p.startswith("settings.json.corrupt-")]
    assert len(kept) == 1
    assert (tmp_path / kept[0]).read_text() == '{"system_prompt": "precious", '
    assert len(s.problems) == 1 and kept[0] in s.problems[0]
    assert "settings.json could not be read" in s.problems[0]
    s.set("system_prompt", "new")
    assert (tmp_path / kept[0]).read_text().startswith('{"system_prompt": "precious"')


def test_presets_keep_their_merge_method_and_old_ones_are_linear(tmp_path):
    """#21: a preset stores its mix's merge method; a presets.json written before merge
    methods existed still loads (linear), and a bad method falls back to linear."""
    entry = {"/a.gguf": {"name": "a", "scale": 0.5, "muted": False, "solo": False}}
    (tmp_path / "presets.json").write_text(
        json.dumps(
            {
                "old": {"bypass": False, "adapters": entry},
                "bad": {"adapters": entry, "merge": {"method": "slerp"}},
            }
        )
    )
    s = Settings(tmp_path)
    assert s.presets.get("old")["merge"] == {"method": "linear"}
    assert s.presets.get("old")["adapters"]["/a.gguf"]["scale"] == 0.5
    assert s.presets.get("bad")["merge"] == {"method": "linear"}
    ties = {"method": "ties", "density": 0.3, "rank": 16, "majority_sign_method": "total"}
    s.presets.save("ties", {"bypass": False, "adapters": entry, "merge": ties})
    assert Settings(tmp_path).presets.get("ties")["merge"] == ties
    s.set("desk", {"bypass": False, "adapters": [], "merge": ties})
    assert Settings(tmp_path).get("desk")["merge"] == ties


def test_move_aside_never_replaces_an_earlier_copy(tmp_path):
    first = tmp_path / "presets.json"
    first.write_text("1")
    a = move_aside(first)
    first.write_text("2")
    b = move_aside(first)
    assert a != b and a.read_text() == "1" and b.read_text() == "2"


def test_conversation_ids_are_safe_file_names(tmp_path):
    c = Conversations(tmp_path / "conv")
    assert c.load("../../etc/passwd") is None
    assert c.load("..") is None
    with pytest.raises(ValueError):
        c.save({"id": "../x", "messages": []})
    conv = c.new()
    conv["messages"] = [{"role": "user", "content": "hi"}]
    c.save(conv)
    assert c.load(conv["id"])["messages"] == [{"role": "user", "content": "hi"}]
    assert [x["id"] for x in c.list()] == [conv["id"]]


def test_corrupt_conversation_is_moved_aside_and_noted(tmp_path):
    c = Conversations(tmp_path)
    (tmp_path / "abc.json").write_text("[")
    assert c.list() == []
    assert os.listdir(tmp_path)[0].startswith("abc.json.corrupt-")
    notes = c.take_problems()
    assert len(notes) == 1 and "abc.json could not be read" in notes[0]
    assert c.take_problems() == []
