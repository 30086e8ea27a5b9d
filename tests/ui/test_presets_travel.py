"""Presets travel (issue 36): export presets to a JSON file and import them (merging,
with a choice on name clashes; a bad file changes nothing), and the strips that differ
from the selected preset are marked."""

from __future__ import annotations

import json

import pytest

from core.errors import UserError


def test_export_and_import_round_trip_with_name_clashes(loaded, tmp_path, monkeypatch):
    w, m = loaded, loaded.mixer
    attn, ffn = w.ids["lora_attn"], w.ids["lora_ffn"]
    m.strips[attn].spin.setValue(0.7)
    m.save_preset("pirate")
    m.strips[attn].spin.setValue(0.0)
    m.strips[ffn].spin.setValue(-0.3)
    m.save_preset("calm")

    every, one = tmp_path / "all.json", tmp_path / "one.json"
    assert m.export_presets(every) == ["calm", "pirate"]
    assert m.preset_box.currentText() == "calm"
    assert m.export_presets(one, selected=True) == ["calm"]
    saved = json.loads(every.read_text())
    assert set(saved) == {"calm", "pirate"} and set(json.loads(one.read_text())) == {"calm"}

    for name in ("calm", "pirate"):
        m.delete_preset(name)
    assert m.settings.presets.names() == []
    assert m.import_presets(every) == ["calm", "pirate"]
    assert m.mix_for_preset("pirate")[attn] == pytest.approx(0.7)
    assert m.mix_for_preset("calm")[ffn] == pytest.approx(-0.3)

    # a clash: the user chooses, per preset: keep both (renamed), replace, or skip
    m.strips[attn].spin.setValue(0.2)
    m.save_preset("pirate")
    for choice, names, pirate in (
        ("skip", ["calm", "pirate"], 0.2),
        ("rename", ["calm", "pirate", "pirate (2)"], 0.2),
        ("replace", ["calm", "pirate", "pirate (2)"], 0.7),
    ):
        asked = []
        monkeypatch.setattr(
            m,
            "ask_clash",
            lambda n, c=choice, a=asked: a.append(n) or (c if n == "pirate" else "skip"),
        )
        m.import_presets(one if choice == "skip" else every)
        assert asked and m.settings.presets.names() == names
        assert m.mix_for_preset("pirate")[attn] == pytest.approx(pirate)
    assert m.mix_for_preset("pirate (2)")[attn] == pytest.approx(0.7)
    on_disk = json.loads(m.settings.presets.path.read_text())
    assert sorted(on_disk) == ["calm", "pirate", "pirate (2)"]


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "object"),
        ('{"x": {"adapters": {"/a.gguf": {"scale": 9.0}}}}', "scale"),
        ('{"x": {"adapters": {"/a.gguf": {"scale": "1"}}}}', "scale"),
        ('{"x": {"adapters": []}}', "adapters"),
        ('{"x": {"bypass": "yes"}}', "bypass"),
        ('{"": {}}', "name"),
        (json.dumps({"n" * 300: {}}), "name"),
        ('{"x": 3}', "x"),
    ],
)
def test_a_bad_file_is_refused_with_a_reason_and_changes_nothing(loaded, tmp_path, text, why):
    m = loaded.mixer
    m.strips[loaded.ids["lora_attn"]].spin.setValue(0.4)
    m.save_preset("keep")
    before = m.settings.presets.path.read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(UserError, match=why):
        m.import_presets(bad)
    assert m.settings.presets.names() == ["keep"]
    assert m.settings.presets.path.read_bytes() == before


def test_strips_that_differ_from_the_selected_preset_are_marked(loaded):
    w, m = loaded, loaded.mixer
    attn, ffn = w.ids["lora_attn"], w.ids["lora_ffn"]
    m.strips[attn].spin.setValue(0.5)
    m.save_preset("p")
    assert not any(s.differs for s in m.strips.values())
    m.strips[ffn].spin.setValue(0.3)
    m.strips[attn].on.click()  # mute
    assert {a for a, s in m.strips.items() if s.differs} == {attn, ffn}
    assert m.strips[ffn].name.full_text.startswith("●")
    assert "0.000" in m.strips[ffn].name.toolTip()  # what the preset has
    m.load_preset("p")
    assert not any(s.differs for s in m.strips.values())
    assert m.strips[ffn].name.full_text == "lora_ffn"
