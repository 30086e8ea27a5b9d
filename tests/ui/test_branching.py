"""Conversation branching (issue #36): editing an earlier message and sending forks the
chat, the old continuation stays as another branch, ‹ › switches between them, only
the shown path goes to the engine, and saved chats (old flat ones too) keep it all."""

from __future__ import annotations

import json

from core import conversation as branching
from core.settings import Conversations


def _reply(text: str, context: int = 0) -> dict:
    meta = {"tokens": 1, "tps": 1.0, "mix": "", "stop": "eos", "context": context}
    return {"role": "assistant", "content": text, "meta": meta}


def _texts(msgs: list[dict]) -> list[str]:
    return [m["content"] for m in msgs]


def test_fork_and_switch_never_lose_a_message():
    """The model alone: forks at two depths, every switch, and all text still there."""
    msgs = [
        {"role": "user", "content": "a"},
        _reply("A"),
        {"role": "user", "content": "b"},
        _reply("B"),
    ]
    branching.fork(msgs, 2, {"role": "user", "content": "b2"})  # fork at the 2nd question
    msgs.append(_reply("B2"))
    branching.fork(msgs, 0, {"role": "user", "content": "a2"})  # then at the first
    assert _texts(msgs) == ["a2"] and branching.branch_of(msgs[0]) == (1, 2)
    everything = {"a", "A", "b", "B", "b2", "B2", "a2"}
    assert {m["content"] for m in branching.every_message(msgs)} == everything
    assert branching.switch(msgs, 0, -1)
    assert _texts(msgs) == ["a", "A", "b2", "B2"]  # that branch's own selection
    assert branching.switch(msgs, 2, -1) and _texts(msgs) == ["a", "A", "b", "B"]
    assert not branching.switch(msgs, 2, -1)  # already the first
    assert branching.switch(msgs, 0, 1) and _texts(msgs) == ["a2"]
    assert branching.switch(msgs, 0, -1) and _texts(msgs) == ["a", "A", "b", "B"]
    assert {m["content"] for m in branching.every_message(msgs)} == everything


def test_edit_forks_and_arrows_switch_the_whole_continuation(window, qtbot, greedy, monkeypatch):
    w = window
    greedy(w, n_predict=2)
    sent: list[list[dict]] = []
    real_chat = w.chat.bridge.chat
    monkeypatch.setattr(
        w.chat.bridge, "chat", lambda msgs, *a, **k: sent.append(msgs) or real_chat(msgs, *a, **k)
    )
    for text in ("Hello", "What is 2+2?"):
        with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
            w.chat.send(text)
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        assert w.chat.regenerate()  # a reply with two versions, in the first branch
    old = [dict(m) for m in w.chat.conversation["messages"]]

    w.chat.edit_message(2)
    assert "new branch" in w.chat.edit_banner.text()
    w.chat.input.setPlainText("What is 3+3?")
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        w.chat.send()
    msgs = w.chat.conversation["messages"]
    assert _texts(msgs[:3]) == ["Hello", old[1]["content"], "What is 3+3?"] and len(msgs) == 4
    assert branching.branch_of(msgs[2]) == (1, 2)
    # the engine got the new path only
    assert [m["content"] for m in sent[-1] if m["role"] == "user"] == ["Hello", "What is 3+3?"]
    text = w.chat.view.toPlainText()
    assert "What is 3+3?" in text and "What is 2+2?" not in text and "branch 2/2" in text
    new_context = w.chat.context_bar.value()
    assert new_context == msgs[-1]["meta"]["context"] > 0

    # ‹ : the old question and its reply, with its versions, come back
    assert w.chat.show_branch(2, -1)
    msgs = w.chat.conversation["messages"]
    assert _texts(msgs) == _texts(old) and len(msgs[3]["versions"]) == 2
    text = w.chat.view.toPlainText()
    assert "What is 2+2?" in text and "What is 3+3?" not in text and "branch 1/2" in text
    assert w.chat.context_bar.value() == old[3]["meta"]["context"]
    tokens = old[3]["meta"]["tokens"]
    assert w.chat.status.full_text.startswith(f"{tokens} token")  # that branch's reply
    assert not w.chat.show_branch(2, -1)  # the first already

    # the next message goes on the branch shown, and the request carries only its path
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        w.chat.send("And 4+4?")
        assert not w.chat.show_branch(2, 1)  # not while a reply streams
    users = [m["content"] for m in sent[-1] if m["role"] == "user"]
    assert users == ["Hello", "What is 2+2?", "And 4+4?"]
    assert len(sent[-1]) == len(w.chat.sampling.system_messages()) + 5

    # the other branch is still whole
    assert w.chat.show_branch(2, 1)
    assert _texts(w.chat.conversation["messages"])[2] == "What is 3+3?"
    assert w.chat.context_bar.value() == new_context
    assert w.chat.show_branch(2, -1)
    assert _texts(w.chat.conversation["messages"])[-2] == "And 4+4?"


def test_a_saved_chat_keeps_every_branch_and_the_selection_after_restart(window, make_window):
    w = window
    conv = w.chat.conversation
    msgs = conv["messages"]
    msgs += [{"role": "user", "content": "first try"}, _reply("one", 40)]
    branching.fork(msgs, 0, {"role": "user", "content": "second try"})
    msgs.append(_reply("two", 50))
    msgs += [{"role": "user", "content": "more"}, _reply("three", 70)]
    branching.fork(msgs, 2, {"role": "user", "content": "more, edited"})
    msgs.append(_reply("four", 80))
    assert w.chat.show_branch(0, -1) and _texts(msgs) == ["first try", "one"]
    w.close()

    w2 = make_window()  # a restart: the last chat opens again
    chat = w2.chat
    assert chat.conversation["id"] == conv["id"]
    assert _texts(chat.conversation["messages"]) == ["first try", "one"]  # the selection
    assert "branch 1/2" in chat.view.toPlainText() and chat.context_bar.value() == 40
    assert chat.show_branch(0, 1)
    assert _texts(chat.conversation["messages"]) == ["second try", "two", "more, edited", "four"]
    assert chat.context_bar.value() == 80
    assert chat.show_branch(2, -1)
    assert _texts(chat.conversation["messages"])[2:] == ["more", "three"]
    # the sidebar's search finds text in a branch that is not shown
    chat.sidebar.search.setText("edited")
    assert chat.sidebar.visible_titles() == [conv["title"]]


def test_an_old_flat_chat_file_loads_and_forks(window, tmp_path):
    """A chat saved before branching (flat messages, reply versions) opens as it was;
    a file with broken branches keeps what is sound."""
    store = Conversations(tmp_path)
    meta = {"tokens": 2, "tps": 1.0, "mix": "m", "stop": "eos", "context": 30}
    old = {
        "id": "20250101-000000-abc123",
        "title": "Old chat",
        "created": 1.0,
        "updated": 2.0,
        "system_prompt": "",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "two",
                "meta": meta,
                "version": 1,
                "versions": [{"content": "one", "meta": meta}, {"content": "two", "meta": meta}],
            },
        ],
    }
    (tmp_path / f"{old['id']}.json").write_text(json.dumps(old))
    conv = store.load(old["id"])
    assert conv["messages"] == old["messages"]
    w = window  # the window shows it as before
    w.chat.store = store
    assert w.chat.open_conversation(old["id"])
    text = w.chat.view.toPlainText()
    assert "hi" in text and "two" in text and "2/2" in text and "branch" not in text
    assert w.chat.context_bar.value() == 30
    branching.fork(conv["messages"], 0, {"role": "user", "content": "hello"})
    store.save(conv)
    again = store.load(old["id"])
    assert again["messages"][0]["branches"][0] == old["messages"]
    assert branching.switch(again["messages"], 0, -1) and again["messages"] == [
        {
            **old["messages"][0],
            "branches": [None, [{"role": "user", "content": "hello"}]],
            "branch": 0,
        },
        old["messages"][1],
    ]
    broken = dict(old, id="20250101-000000-abc124")
    broken["messages"] = [
        {"role": "user", "content": "x", "branch": 7, "branches": [[{"role": "nobody"}], 3, None]},
        {
            "role": "user",
            "content": "y",
            "branch": 1,
            "branches": [[{"role": "user", "content": "z"}], None],
        },
    ]
    (tmp_path / f"{broken['id']}.json").write_text(json.dumps(broken))
    msgs = store.load(broken["id"])["messages"]
    assert msgs[0] == {"role": "user", "content": "x"}  # nothing sound to switch to
    assert branching.branch_of(msgs[1]) == (1, 2)


def test_switching_at_the_end_of_a_long_chat_keeps_the_arrows_in_place(window, qtbot):
    """At the end of the chat, ‹ › must not jump to the other branch's end: the view
    stays put, so the arrows stay under the pointer for the next click."""
    w = window
    w.resize(1024, 700)
    w.tabs.setCurrentIndex(0)
    msgs = w.chat.conversation["messages"]
    for n in range(12):
        msgs += [{"role": "user", "content": f"question {n}"}, _reply(f"answer {n}\n\n" * 4)]
    branching.fork(msgs, 16, {"role": "user", "content": "question 8, edited"})
    msgs.append(_reply("short"))
    w.chat.render()
    qtbot.wait(50)
    bar = w.chat.view.verticalScrollBar()
    assert bar.value() == bar.maximum() > 0
    before = bar.value()
    assert w.chat.show_branch(16, -1)  # the longer branch
    qtbot.wait(50)
    assert bar.maximum() > before and abs(bar.value() - before) < 20  # to the line
