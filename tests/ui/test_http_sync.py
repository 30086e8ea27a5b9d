"""Live sync between the HTTP API (served from the GUI's qasync loop) and the desk."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("core.http.app")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None) -> object:
    """Runs in a worker thread (the server lives on the GUI thread's loop)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        payload = json.loads(r.read())
    return payload


def in_thread(qtbot, fn, *args, timeout=60000):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # surfaced in the main thread below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=timeout)
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def served(loaded, qloop, qtbot):
    w = loaded
    w.server.port.setValue(free_port())
    w.server.toggle.setChecked(True)
    qtbot.waitUntil(lambda: w.server.running, timeout=10000)
    yield w, w.server.base_url()
    fut = asyncio.ensure_future(w.server.stop(remember=False))
    qtbot.waitUntil(fut.done, timeout=10000)
    assert not w.server.running


def test_post_lora_adapters_moves_the_slider(served, qtbot):
    w, url = served
    attn = w.ids["lora_attn"]
    body = [{"id": attn, "scale": 1.25}]
    payload = in_thread(qtbot, http, "POST", url + "/lora-adapters", body)
    assert payload == {"success": True}
    qtbot.waitUntil(lambda: w.mixer.strips[attn].spin.value() == pytest.approx(1.25), timeout=5000)
    assert w.mixer.strips[attn].slider.value() == 125
    assert w.engine.get_mix()[attn] == pytest.approx(1.25)
    assert any(
        "POST /lora-adapters" in line for line in w.server.log_view.toPlainText().splitlines()
    )


def test_slider_shows_in_get_lora_adapters_immediately(served, qtbot):
    w, url = served
    ffn = w.ids["lora_ffn"]
    w.mixer.strips[ffn].spin.setValue(-0.75)
    entries = in_thread(qtbot, http, "GET", url + "/lora-adapters")
    scales = {e["id"]: e["scale"] for e in entries}
    assert scales[ffn] == pytest.approx(-0.75)
    w.mixer.bypass.setChecked(True)
    entries = in_thread(qtbot, http, "GET", url + "/lora-adapters")
    assert all(e["scale"] == 0.0 for e in entries)


def test_adapter_loading_over_http_is_off_unless_ticked(served, qtbot, ref_dir):
    w, url = served
    assert not w.server.allow_lora.isChecked()
    path = str(ref_dir / "adapters" / "lora_attn.gguf")
    with pytest.raises(urllib.error.HTTPError) as e:
        in_thread(qtbot, http, "POST", url + "/lora-adapters/load", {"path": path})
    assert e.value.code == 403
    assert w.adapters.tree.topLevelItemCount() == 3


def test_adapter_loaded_over_http_appears_in_the_desk(loaded, qloop, qtbot, ref_dir):
    w = loaded
    w.server.allow_lora.setChecked(True)  # before the server starts
    assert w.settings.get("server")["allow_runtime_lora"] is True
    assert ref_dir / "adapters" in w.server.lora_dirs()  # the desk's adapters' folder
    w.server.port.setValue(free_port())
    w.server.toggle.setChecked(True)
    qtbot.waitUntil(lambda: w.server.running, timeout=10000)
    url = w.server.base_url()
    path = str(ref_dir / "adapters" / "lora_attn.gguf")
    entry = in_thread(
        qtbot, http, "POST", url + "/lora-adapters/load", {"path": path, "scale": 0.5}
    )
    qtbot.waitUntil(lambda: entry["id"] in w.mixer.strips, timeout=2000)
    assert w.mixer.strips[entry["id"]].spin.value() == pytest.approx(0.5)
    assert w.adapters.tree.topLevelItemCount() == 4
    fut = asyncio.ensure_future(w.server.stop(remember=False))
    qtbot.waitUntil(fut.done, timeout=10000)


def test_gui_and_http_requests_share_one_engine(served, qtbot, greedy):
    w, url = served
    greedy(w, n_predict=4)
    sources = []
    w.bridge.request_started.connect(lambda ev: sources.append(ev.source))
    with qtbot.waitSignal(w.chat.reply_finished, timeout=120000):
        w.chat.send("Hi")
        out = in_thread(
            qtbot,
            http,
            "POST",
            url + "/completion",
            {"prompt": "Hello", "n_predict": 4, "temperature": 0},
        )
    assert out["tokens_predicted"] == 4 if "tokens_predicted" in out else out["content"]
    assert "gui" in sources and any(s != "gui" for s in sources)
    assert "generation" in w.server.log_view.toPlainText()
    # each generation also logs how it finished, from the engine's request_finished event
    qtbot.waitUntil(
        lambda: w.server.log_view.toPlainText().count(" done: 4 tokens") >= 2, timeout=5000
    )


def test_closing_the_window_stops_the_server_then_the_engine_thread(served, qtbot):
    w, url = served
    w.close()
    qtbot.waitUntil(lambda: not w.server.running, timeout=5000)
    qtbot.waitUntil(lambda: not w.engine.health()[0], timeout=5000)  # its loop stopped
    assert not w.isVisible()
    assert (w.settings.get("server") or {}).get("enabled") is True  # restarts next time
