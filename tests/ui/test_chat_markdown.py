"""The chat as in LM Studio / Jan (issue #17): markdown-it-py + pygments rendered live
while streaming, Copy per code block and per message, reply versions, shortcuts,
"Reading prompt…" then time to first token and live tok/s."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication

from ui.markdown import Colors, render

REPLY = "Here is **bold** and code:\n\n```python\ndef f():\n    return 1\n```\n\nand `inline`."


class Streaming:
    """Stands for a Generation in flight (the pane only asks it to cancel)."""

    n_tokens = 0

    def cancel(self):
        pass


def test_markdown_has_no_html_passthrough_and_highlights_code():
    codes = []
    out = render('<img src="x"> **b**\n\n```python\nx = 1\n```', Colors(), codes, "3")
    assert "&lt;img" in out and "<img" not in out and "<strong>b</strong>" in out
    assert codes == ["x = 1\n"] and 'href="copy:code:3.0"' in out
    assert "<span style=" in out  # pygments, inline styles (Qt has no stylesheet for it)
    assert "white-space:pre-wrap" in out  # long lines wrap: no sideways transcript


def test_a_streaming_reply_is_rendered_as_markdown_not_raw_text(window):
    w = window
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "show me"},
        {"role": "assistant", "content": REPLY[:-20]},  # the fence is still open
    ]
    w.chat.gen = Streaming()
    try:
        w.chat.render()
        text = w.chat.view.toPlainText()
        assert "**bold**" not in text and "bold" in text  # not raw Markdown
        assert "```" not in text and "def f():" in text
        assert "Copy" in text  # the code block's Copy link, already while streaming
    finally:
        w.chat.gen = None
    w.chat.conversation["messages"][-1]["content"] = REPLY
    w.chat.render()
    assert "inline" in w.chat.view.toPlainText() and "```" not in w.chat.view.toPlainText()


def test_copy_a_code_block_and_a_message(window):
    w = window
    w.chat.conversation["messages"] = [
        {"role": "user", "content": "show me"},
        {"role": "assistant", "content": REPLY, "meta": {"tokens": 3, "tps": 1.0}},
    ]
    w.chat.render()
    clip = QGuiApplication.clipboard()
    w.chat._anchor(QUrl("copy:code:1.0"))
    assert clip.text() == "def f():\n    return 1\n"
    w.chat._anchor(QUrl("copy:msg:1"))
    assert clip.text() == REPLY
    w.chat._anchor(QUrl("copy:msg:0"))
    assert clip.text() == "show me"


def test_regenerate_keeps_versions(window, qtbot, greedy):
    w = window
    greedy(w, n_predict=3)
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        w.chat.send("Hello")
    first = w.chat.conversation["messages"][-1]["content"]
    w.sampling.set_values({"temperature": 1.5, "seed": 7})
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        assert w.chat.regenerate()
    msgs = w.chat.conversation["messages"]
    assert len(msgs) == 2 and len(msgs[1]["versions"]) == 2 and msgs[1]["version"] == 1
    shown = lambda: " ".join(w.chat.view.toPlainText().split())  # noqa: E731 (the ‹ › pads)
    assert "‹ 2/2 ›" in shown()
    w.chat._anchor(QUrl("ver:1:-1"))
    assert msgs[1]["content"] == first and "‹ 1/2 ›" in shown()
    saved = w.chat.store.load(w.chat.conversation["id"])
    assert saved["messages"][1]["version"] == 0 and len(saved["messages"][1]["versions"]) == 2


def test_status_says_reading_prompt_then_first_token_and_tok_s(window, qtbot, greedy):
    w = window
    greedy(w, n_predict=40)
    said = []
    real = w.chat.status.setText
    w.chat.status.setText = lambda t: (said.append(t), real(t))
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        assert w.chat.send("Count from one to twenty.")
    assert said[0] == "Reading prompt…"
    live = [s for s in said if s.startswith("First token after")]
    assert live and any("tok/s" in s for s in live)
    assert " tokens · " in said[-1] and "tok/s" in said[-1]  # the final count


def test_shortcuts_new_chat_regenerate_focus_input(window, qtbot):
    w = window
    w.activateWindow()
    w.chat.conversation["messages"] = [{"role": "user", "content": "x"}]
    called = []
    w.chat.regenerate = lambda: called.append("regen")  # the shortcut's target
    old = w.chat.conversation["id"]
    w.chat.view.setFocus()
    qtbot.keyClick(w.chat.view, Qt.Key_L, Qt.ControlModifier)
    assert w.chat.input.hasFocus()
    qtbot.keyClick(w.chat.input, Qt.Key_N, Qt.ControlModifier)
    assert w.chat.conversation["id"] != old
