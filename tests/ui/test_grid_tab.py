"""The X/Y grid tab (#21): a small grid runs as one batch, its cards fill, "Use this mix"
puts a cell's mix on the desk, and the exports write real files."""

from __future__ import annotations

import csv

from PySide6.QtGui import QImage

from core.lora.merge import MergeSpec
from core.lora.mix import Mix


def test_grid_tab_runs_cards_fill_and_use_this_mix(loaded, qtbot, greedy, tmp_path):
    w, ids = loaded, loaded.ids
    greedy(w, n_predict=4)
    g = w.grid
    assert w.tabs.tabText(w.tabs.indexOf(g.parentWidget())) == "X/Y grid"
    w.tabs.setCurrentIndex(w.tabs.indexOf(g.parentWidget()))
    g.x.set_axis("scale", "0, 0.5, 1", adapter=ids["lora_attn"])
    g.y.set_axis("seed", "3, 4")
    started: list = []  # RequestStarted events
    w.bridge.request_started.connect(started.append)

    with qtbot.waitSignal(g.finished, timeout=180000):
        assert g.run("Name a fruit.")
        assert len(g.cards) == 6 and not g.run_btn.isEnabled()
    assert "6 cells (3 × 2)" in g.status.text()
    # one submit_many: the six requests were announced together, with their own mixes
    assert len(started) == 6
    assert sorted(e.mix.get(ids["lora_attn"], 0.0) for e in started) == [
        0.0,
        0.0,
        0.5,
        0.5,
        1.0,
        1.0,
    ]
    for card in g.cards:
        assert card.done.stop_type == "limit" and len(card.done.tokens) == 4
        assert card.reply.text() == card.done.content and card.text
        assert "4 tokens" in card.meta.text() and "stop: limit" in card.meta.text()
        assert dict(card.done.mix) == {k: v for k, v in card.cell.mix.items() if v}
    card = g.cards[5]  # lora_attn ×1, seed 4
    assert card.cell.x_label == "lora_attn ×1" and card.cell.y_label == "seed 4"
    assert "lora_attn ×1.00" in card.mix.text()
    assert g.run_btn.isEnabled() and g.export_btn.isEnabled()

    # "Use this mix": the desk (and so the engine) now plays the cell's mix, one undo step
    before = w.mixer.desk_mix()
    card.use.click()
    assert w.mixer.desk_mix() == card.cell.mix
    assert w.engine.get_mix() == card.cell.mix
    assert w.mixer.strips[ids["lora_attn"]].value == 1.0
    assert w.mixer.undo() and w.mixer.desk_mix() == before
    # a cell of a method axis carries its method to the desk's selector too
    g.use_mix(Mix({ids["lora_ffn"]: 0.5}, MergeSpec.make("ties", density=0.3)))
    assert w.mixer.merge_spec() == MergeSpec.make("ties", density=0.3)
    assert w.engine.get_mix().merge == MergeSpec.make("ties", density=0.3)
    assert w.mixer.undo() and w.mixer.merge_spec().method == "linear"

    # exports: Markdown (a row per cell), CSV (parses back), PNG (an image of the grid)
    md = g.export("md", tmp_path / "grid.md").read_text(encoding="utf-8")
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 6 and "Name a fruit." in md
    with open(g.export("csv", tmp_path / "grid.csv"), newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert [r["reply"] for r in got] == [c.done.content for c in g.cards]
    assert got[5]["x"] == "lora_attn ×1" and got[5]["seed"] == "4"
    img = QImage(str(g.export("png", tmp_path / "grid.png")))
    assert not img.isNull() and img.width() >= g.grid_host.width() - 1


def test_grid_tab_refuses_a_bad_grid_with_a_message(loaded, qtbot):
    w, ids = loaded, loaded.ids
    g = w.grid
    g.x.set_axis("scale", "0, banana", adapter=ids["lora_ffn"])
    assert not g.run("Hi")
    assert "'banana' is not a number" in g.status.text() and not g.cards
    g.x.set_axis("preset", "no such preset")
    assert not g.run("Hi")
    assert "unknown preset 'no such preset'" in g.status.text()
    g.x.set_axis("method", "linear, mean")
    assert not g.run("Hi")
    assert "merge method must be one of" in g.status.text()
    g.x.set_axis("seed", ", ".join(str(i) for i in range(9)))
    g.y.set_axis("seed", "1")
    assert not g.run("Hi")
    assert "vary the same thing" in g.status.text()
    assert g.run_btn.isEnabled() and not g.running
