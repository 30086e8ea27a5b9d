"""The sidebar of saved chats: listed newest first, opened by a click, renamed in
place, deleted with Undo, searched by title and by message text."""

from __future__ import annotations

from PySide6.QtCore import Qt

from core.settings import Conversations


def _chat(store: Conversations, title: str, *texts: str) -> str:
    conv = store.new()
    conv["title"] = title
    conv["messages"] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)
    ]
    store.save(conv)
    return conv["id"]


def _item(side, title):
    return next(
        side.list.item(i) for i in range(side.list.count()) if side.list.item(i).text() == title
    )


def test_sidebar_lists_opens_renames_deletes_and_searches(window, qtbot):
    w = window
    store = w.chat.store
    a = _chat(store, "Pirate poems", "write a poem", "Arr, the sea…")
    b = _chat(store, "Sorting in Python", "how do I sort a list?", "Use sorted(xs).")
    w.chat.refresh_history()
    side = w.chat.sidebar
    assert side.titles()[:3] == ["New chat (unsaved)", "Sorting in Python", "Pirate poems"]

    # open by a click
    qtbot.mouseClick(
        side.list.viewport(),
        Qt.LeftButton,
        pos=side.list.visualItemRect(_item(side, "Pirate poems")).center(),
    )
    assert w.chat.conversation["id"] == a
    assert "Arr, the sea" in w.chat.view.toPlainText()

    # rename in place (what F2 + typing does)
    _item(side, "Sorting in Python").setText("Sorting")
    assert store.load(b)["title"] == "Sorting" and "Sorting" in side.titles()

    # search: by title, then by a word only the messages contain
    side.search.setText("pirate")
    assert side.visible_titles() == ["Pirate poems"]
    side.search.setText("sorted(xs)")
    assert side.visible_titles() == ["Sorting"]
    side.search.setText("")
    assert len(side.visible_titles()) == side.list.count()

    # delete the open chat: a new one opens, the file is gone, Undo brings it back
    side.list.setCurrentItem(_item(side, "Pirate poems"))
    side.delete_btn.click()
    assert store.load(a) is None and "Pirate poems" not in side.titles()
    assert w.chat.conversation["id"] != a and side.undo_bar.isVisible()
    side.undo_btn.click()
    assert store.load(a)["messages"][1]["content"] == "Arr, the sea…"
    assert w.chat.conversation["id"] == a and "Pirate poems" in side.titles()
    assert not side.undo_bar.isVisible()


def test_renaming_to_nothing_keeps_the_title(window):
    store = window.chat.store
    cid = _chat(store, "Keep me", "hi")
    window.chat.refresh_history()
    assert not window.chat.rename_conversation(cid, "   ")
    assert store.load(cid)["title"] == "Keep me" and "Keep me" in window.chat.sidebar.titles()
