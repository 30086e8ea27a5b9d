"""Context use (issue 36): a bar in the chat shows the tokens the current chat uses of
the context (prompt + reply so far, live while a reply streams), and its tooltip says
what happens when it fills. The numbers are the engine's own (its prompt report and
its token events), not a second tokenization."""

from __future__ import annotations

import dataclasses


def test_the_context_bar_counts_prompt_and_reply_while_it_streams(window, qtbot, greedy):
    w, chat = window, window.chat
    bar = chat.context_bar
    assert bar.isVisible() and bar.maximum() == w.engine.ctx_size and bar.value() == 0
    assert "stops" in bar.toolTip()  # this engine runs without --context-shift
    greedy(w, n_predict=24)
    seen = []
    bar.valueChanged.connect(seen.append)
    assert chat.send("Tell me about the moon.")
    gen = chat.gen
    qtbot.waitUntil(lambda: not chat.generating, timeout=60000)
    done = chat.conversation["messages"][-1]["meta"]
    prompt_n, reply_n = gen.prompt_n, done["tokens"]
    assert prompt_n > 10 and reply_n > 1
    assert bar.value() == prompt_n + reply_n == done["context"]
    # live: the prompt first, then more as tokens streamed in
    assert seen[0] == prompt_n and len(set(seen)) > 2 and seen == sorted(seen)
    assert f"{prompt_n + reply_n} / {w.engine.ctx_size}" in bar.text()

    # the next message's prompt holds the whole chat so far: the count goes on from there
    assert chat.send("And the sun?")
    gen = chat.gen
    qtbot.waitUntil(lambda: not chat.generating, timeout=60000)
    assert gen.prompt_n > prompt_n + reply_n
    total, cid = bar.value(), chat.conversation["id"]
    assert total == gen.prompt_n + chat.conversation["messages"][-1]["meta"]["tokens"]

    chat.new_conversation()  # a new chat starts empty …
    assert bar.value() == 0
    assert chat.open_conversation(cid)  # … and a saved one shows what it used
    assert bar.value() == total


def test_a_full_context_is_said(window, qtbot, greedy, monkeypatch):
    w, chat = window, window.chat
    greedy(w, n_predict=2000)
    params = chat.sampling.params
    # a reply that never ends by itself (the form has no ignore-EOS box): it runs into
    # the end of the 1024-token context
    monkeypatch.setattr(
        chat.sampling, "params", lambda: dataclasses.replace(params(), ignore_eos=True)
    )
    text = " ".join(f"word{i}" for i in range(220))  # ~700 tokens
    assert chat.send(text)
    cid = chat.conversation["id"]
    qtbot.waitUntil(lambda: not chat.generating, timeout=180000)
    bar = chat.context_bar
    assert bar.value() >= bar.maximum() - 1
    assert "context full" in chat.status.full_text
    chat.new_conversation()
    assert bar.value() == 0
    assert chat.open_conversation(cid)  # a saved chat shows what it used
    assert bar.value() >= bar.maximum() - 1
