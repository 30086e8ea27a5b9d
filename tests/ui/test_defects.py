"""Defects a new user met on the real window (issue #17), each reproduced first."""

from __future__ import annotations

from PySide6.QtCore import QItemSelectionModel, Qt


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
