"""The desk's rule without Qt: faders + mute + solo + bypass -> the engine mix."""

from __future__ import annotations

import sys

from ui.desk import Channel, desk_mix, silenced


def test_faders_alone_are_the_mix():
    assert desk_mix({0: Channel(0.5), 1: Channel(-1.25)}) == {0: 0.5, 1: -1.25}


def test_mute_silences_one_strip():
    chans = {0: Channel(0.5, muted=True), 1: Channel(1.0)}
    assert desk_mix(chans) == {0: 0.0, 1: 1.0}
    assert silenced(chans) == {0}


def test_solo_leaves_only_soloed_strips_and_mute_still_wins():
    chans = {0: Channel(0.5, solo=True), 1: Channel(1.0), 2: Channel(2.0, muted=True, solo=True)}
    assert desk_mix(chans) == {0: 0.5, 1: 0.0, 2: 0.0}
    assert silenced(chans) == {1, 2}


def test_bypass_silences_everything_and_keeps_the_faders():
    chans = {0: Channel(0.5, solo=True), 1: Channel(1.0)}
    assert desk_mix(chans, bypass=True) == {0: 0.0, 1: 0.0}
    assert desk_mix(chans) == {0: 0.5, 1: 0.0}  # the desk is as it was after bypass


def test_a_preset_entry_or_its_absence_is_a_channel():
    assert Channel.from_entry({"scale": 0.25, "muted": 1, "solo": 0}) == Channel(0.25, True, False)
    assert Channel.from_entry(None) == Channel(0.0)
    assert desk_mix({}) == {}


def test_the_rule_needs_no_qt():
    assert not any(m.startswith("PySide6") for m in sys.modules if m.startswith("ui.desk"))
    import ui.desk

    src = open(ui.desk.__file__, encoding="utf-8").read()
    assert "PySide6" not in src and "Qt" not in src.replace("without Qt", "")
