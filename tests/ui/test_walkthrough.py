"""docs/walkthrough.md ("Mixing in five minutes", README's short version), step by step,
in the real window (#17 "Done when").

The window is made as `make run` makes it (ui.app.create_window with no flags: the
default SmolLM2 and the demo adapters under resources/adapters). Each step is done with
the widgets a user would use (typing, Ctrl+Enter, faders, S/M buttons, Bypass all,
Save… and its dialog, the A/B tab, File → Export mix, the Server tab) and asserts what
the user would see. Two liberties, both settings a user can make: sampling is greedy
with a short budget (the suite's cost, and comparable replies), and the server listens
on a free port (8080 may be taken on a test machine)."""

from __future__ import annotations

import asyncio
import itertools
import urllib.request

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QFileDialog, QInputDialog, QPushButton
from test_http_sync import free_port, in_thread

from core.cli import parse_args
from core.lora.adapter import load_adapter
from core.serve.sampling import SamplingParams
from ui.compare import BASE
from ui.mixer import TICKS

QUESTION = "Tell me about the moon."
N_PREDICT = 12
WAIT_MS = 300000  # a busy machine is slow; a hang fails instead of blocking the suite


def nonzero(mix) -> dict[int, float]:
    return {int(a): float(s) for a, s in dict(mix).items() if float(s) != 0.0}


def curl_post(url: str, data: str) -> bytes:
    """What `curl -X POST URL -d DATA` sends: the raw body with curl's default
    Content-Type (application/x-www-form-urlencoded), no JSON header."""
    req = urllib.request.Request(url, data=data.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


@pytest.fixture
def app_window(qtbot, qloop):
    """`make run`: the window, its own engine, the default model and the demo adapters."""
    from ui.app import create_window

    win = create_window(parse_args([]))
    win.show()
    yield win
    if win.server.runner is not None:
        fut = asyncio.ensure_future(win.server.stop(remember=False))
        qtbot.waitUntil(fut.done, timeout=10000)
    win.close()
    win.engine.stop()


def greedy_budget(w) -> None:
    w.sampling.set_values(
        {"temperature": 0.0, "n_predict": N_PREDICT, "seed": 0, "repeat_penalty": 1.0}
    )


def expected_reply(w, mix) -> str:
    """The reply the engine gives this question under ``mix`` with the window's own
    sampling settings and system prompt (what the chat must show)."""
    messages = w.sampling.system_messages() + [{"role": "user", "content": QUESTION}]
    params: SamplingParams = w.sampling.params()
    done = w.engine.complete(w.engine.chat_prompt(messages), params, mix=mix, cache_prompt=False)
    return done.content


def last_reply(w) -> dict:
    return w.chat.conversation["messages"][-1]


def click_button(parent, text: str) -> None:
    (btn,) = [b for b in parent.findChildren(QPushButton) if b.text() == text]
    btn.click()


def test_mixing_in_five_minutes(app_window, qtbot, tmp_path, monkeypatch):
    w = app_window

    # 1. `make run`: SmolLM2 and the three demo adapters, all at 0: the base model.
    qtbot.waitUntil(lambda: w.engine.ready and len(w.mixer.strips) == 3, timeout=WAIT_MS)
    assert w.engine.path.name.lower().startswith("smollm2")
    ids = {s.info["name"]: aid for aid, s in w.mixer.strips.items()}
    assert sorted(ids) == ["hype", "pirate", "terse"]
    assert all(s.spin.value() == 0.0 for s in w.mixer.strips.values())
    assert nonzero(w.engine.get_mix()) == {}
    greedy_budget(w)
    model = w.engine.model

    mixes = []  # the mix of every request the window starts
    w.bridge.request_started.connect(lambda ev: mixes.append(nonzero(ev.mix)))

    # 2. Ask something in the chat, Ctrl+Enter.
    w.chat.input.setFocus()
    qtbot.keyClicks(w.chat.input, QUESTION)
    with qtbot.waitSignal(w.chat.reply_finished, timeout=WAIT_MS):
        qtbot.keyClick(w.chat.input, Qt.Key_Return, Qt.ControlModifier)
    base_reply = last_reply(w)["content"]
    assert mixes[-1] == {}
    assert base_reply == expected_reply(w, {})
    assert QUESTION in w.chat.view.toPlainText()
    assert base_reply.split()[0] in w.chat.view.toPlainText()

    # 3. Pirate to 1, Regenerate: same question, pirate voice, nothing reloads.
    w.mixer.strips[ids["pirate"]].slider.setValue(1 * TICKS)
    assert w.mixer.strips[ids["pirate"]].spin.value() == 1.0
    with qtbot.waitSignal(w.chat.reply_finished, timeout=WAIT_MS):
        w.chat.regen_btn.click()
    assert mixes[-1] == {ids["pirate"]: 1.0}
    pirate_reply = last_reply(w)["content"]
    assert pirate_reply == expected_reply(w, {ids["pirate"]: 1.0})
    assert pirate_reply != base_reply
    assert w.engine.model is model and not w.engine.loading  # nothing reloaded
    assert len(last_reply(w)["versions"]) == 2  # the base reply is kept as version 1
    assert "2/2" in w.chat.view.toPlainText()

    # 4. hype 0.5, pirate back to 0.5: a 50/50 mix; Solo, Mute, Bypass all.
    w.mixer.strips[ids["hype"]].slider.setValue(TICKS // 2)
    w.mixer.strips[ids["pirate"]].slider.setValue(TICKS // 2)
    half = {ids["hype"]: 0.5, ids["pirate"]: 0.5}
    assert nonzero(w.engine.get_mix()) == half
    w.mixer.strips[ids["pirate"]].solo.click()  # hear it alone
    assert nonzero(w.engine.get_mix()) == {ids["pirate"]: 0.5}
    w.mixer.strips[ids["pirate"]].solo.click()
    w.mixer.strips[ids["hype"]].on.click()  # Mute: silenced, fader kept
    assert nonzero(w.engine.get_mix()) == {ids["pirate"]: 0.5}
    assert w.mixer.strips[ids["hype"]].spin.value() == 0.5
    w.mixer.strips[ids["hype"]].on.click()
    w.mixer.bypass.click()  # the plain base
    assert nonzero(w.engine.get_mix()) == {}
    w.mixer.bypass.click()
    assert nonzero(w.engine.get_mix()) == half

    # 5. Save… the desk as "Loud pirate" (typed into the dialog), then A/B compare it
    # against the base model: one prompt, both sides, one batch.
    def name_it():
        dlg = QApplication.activeModalWidget()
        assert isinstance(dlg, QInputDialog)
        dlg.setTextValue("Loud pirate")
        dlg.accept()

    QTimer.singleShot(0, name_it)
    click_button(w.mixer, "Save…")
    assert "Loud pirate" in w.mixer.settings.presets.names()
    tabs = w.tabs
    tabs.setCurrentIndex(next(i for i in range(tabs.count()) if tabs.tabText(i) == "A/B compare"))
    w.compare.a.combo.setCurrentText("Loud pirate")
    w.compare.b.combo.setCurrentText(BASE)
    qtbot.keyClicks(w.compare.prompt, QUESTION)
    order, stamps = itertools.count(), {"A": [], "B": []}
    with qtbot.waitSignal(w.compare.finished, timeout=WAIT_MS):
        w.compare.run_btn.click()
        for side in (w.compare.a, w.compare.b):
            side.gen.token.connect(lambda _t, k=side.title.text(): stamps[k].append(next(order)))
    a, b = w.compare.a.done, w.compare.b.done
    assert nonzero(a.mix) == half and nonzero(b.mix) == {}
    assert stamps["B"][0] < stamps["A"][-1] and stamps["A"][0] < stamps["B"][-1]  # together
    assert b.content == base_reply  # the base side is the base model's reply
    assert w.compare.a.view.toPlainText().strip() == a.content.strip()

    # 6. Export it: File → Export mix → as one LoRA GGUF (for llama-server).
    out = tmp_path / "loud-pirate.gguf"
    monkeypatch.setattr(
        QFileDialog, "getSaveFileName", staticmethod(lambda *a, **k: (str(out), ""))
    )
    with qtbot.waitSignal(w.exporter.finished, timeout=WAIT_MS):
        w.exporter.actions["lora"].trigger()
    assert out.is_file() and str(out) in w.statusBar().currentMessage()
    load_adapter(out, w.engine.config)  # a valid adapter of this model
    # the export alone at scale 1 predicts what the mix predicts, token by token
    prompt = w.engine.chat_prompt([{"role": "user", "content": QUESTION}])
    text = prompt + w.engine.tokenizer.encode(a.content)[:N_PREDICT]
    exported = w.engine.add_adapter(out)
    try:
        want = w.engine.score(text, half, len(prompt))
        got = w.engine.score(text, {exported: 1.0}, len(prompt))
    finally:
        w.engine.remove_adapter(exported)
    assert [s.top1 for s in got] == [s.top1 for s in want]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(got, want)) < 1e-2  # f16 export

    # The same desk over HTTP: the Server tab, then the walkthrough's curl moves a fader.
    assert w.server.port.value() == 8080  # the walkthrough's localhost:8080
    w.server.port.setValue(free_port())
    w.server.toggle.click()
    qtbot.waitUntil(lambda: w.server.running, timeout=10000)
    url = w.server.base_url()
    # adapters load in alphabetical order, as the walkthrough says: hype 0, pirate 1, terse 2
    assert ids == {"hype": 0, "pirate": 1, "terse": 2}
    body = '[{"id":1,"scale":0.8},{"id":0,"scale":0.5}]'
    assert in_thread(qtbot, curl_post, url + "/lora-adapters", body)
    pirate, hype = w.mixer.strips[1], w.mixer.strips[0]
    qtbot.waitUntil(lambda: pirate.spin.value() == pytest.approx(0.8), timeout=5000)
    assert pirate.slider.value() == int(0.8 * TICKS)
    qtbot.waitUntil(lambda: hype.spin.value() == pytest.approx(0.5), timeout=5000)
    # llama-server's rule: ids the list leaves out go to 0
    assert nonzero(w.engine.get_mix()) == {1: 0.8, 0: 0.5}
    assert w.mixer.strips[ids["terse"]].spin.value() == 0.0
