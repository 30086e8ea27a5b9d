"""The server started from the window's Server tab honours every server flag that
``--headless`` honours: it is built with the same ``ServerSettings.from_args``, plus
the tab's own fields (host, port, API key, adapter loading). Each test starts the
window's real server on 127.0.0.1 with one group of flags and asks it over HTTP.

(The tab used to build its settings from host, port, key and CORS only, so the
window's server ignored --temp, -n, --alias, --metrics, --slot-save-path, ...)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.error
import urllib.request

import pytest
from test_http_sync import free_port, in_thread

from core.cli import parse_args

PROMPT = "Once upon a time"


def call(method: str, url: str, body=None, headers: dict | None = None):
    """(status, headers, text) of one request; runs in a worker thread (the server
    lives on the GUI thread's loop)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


@pytest.fixture
def serve(qtbot, qloop, clean_engine):
    """serve(flags) -> (window, base URL): the window over the session engine, built
    from main.py's flags as run_gui builds it, its server started from the tab."""
    from ui.app import build_window

    made = []

    def start(flags: list[str]):
        win = build_window(parse_args(flags), clean_engine)
        made.append(win)
        win.server.port.setValue(free_port())  # the tab's own field wins over --port
        win.server.toggle.setChecked(True)
        qtbot.waitUntil(lambda: win.server.running, timeout=10000)
        return win, win.server.base_url()

    yield start
    for win in made:
        if win.server.runner is not None:
            fut = asyncio.ensure_future(win.server.stop(remember=False))
            qtbot.waitUntil(fut.done, timeout=10000)
        win.close()
        win.deleteLater()


def ask(qtbot, method: str, url: str, body=None, headers: dict | None = None):
    status, head, text = in_thread(qtbot, call, method, url, body, headers)
    is_json = head.get("Content-Type", "").startswith("application/json")
    return status, head, (json.loads(text) if is_json else text)


def test_sampling_flags_are_the_requests_defaults(serve, qtbot):
    _, url = serve(["--temp", "0.9", "--top-k", "50", "--seed", "42", "-n", "6"])
    st, _, props = ask(qtbot, "GET", url + "/props")
    p = props["default_generation_settings"]["params"]
    assert st == 200 and (p["temperature"], p["top_k"], p["seed"], p["n_predict"]) == (
        0.9,
        50,
        42,
        6,
    )
    body = {"prompt": PROMPT, "ignore_eos": True}
    outs = [ask(qtbot, "POST", url + "/completion", body)[2] for _ in range(2)]
    assert outs[0]["tokens_predicted"] == 6  # -n is the default n_predict
    assert outs[0]["generation_settings"]["temperature"] == 0.9
    assert outs[0]["content"] == outs[1]["content"]  # --seed: requests without one repeat


def test_alias_and_tags_name_the_model(serve, qtbot):
    _, url = serve(["--alias", "smol,smol-135m", "--tags", "tiny,test"])
    st, _, models = ask(qtbot, "GET", url + "/v1/models")
    base = models["data"][0]
    assert st == 200 and base["id"] == "smol"
    assert base["aliases"] == ["smol", "smol-135m"] and base["tags"] == ["tiny", "test"]
    assert ask(qtbot, "GET", url + "/props")[2]["model_alias"] == "smol"


def test_metrics_flag_serves_metrics(serve, qtbot):
    _, url = serve(["--metrics"])
    ask(qtbot, "POST", url + "/completion", {"prompt": PROMPT, "n_predict": 2})
    st, _, text = ask(qtbot, "GET", url + "/metrics")
    assert st == 200 and "llamacpp:tokens_predicted_total" in text


def test_slot_save_path_saves_a_slot(serve, qtbot, tmp_path):
    _, url = serve(["--slot-save-path", str(tmp_path)])
    body = {"prompt": PROMPT, "n_predict": 2, "id_slot": 0, "cache_prompt": True}
    assert ask(qtbot, "POST", url + "/completion", body)[0] == 200
    st, _, out = ask(qtbot, "POST", url + "/slots/0?action=save", {"filename": "s.bin"})
    assert st == 200 and out["n_saved"] > 0
    assert (tmp_path / "s.bin").stat().st_size == out["n_written"]


def test_every_api_key_and_the_cors_origins(serve, qtbot):
    origin = "http://app.example"
    win, url = serve(["--api-key", "k1", "--api-key", "k2", "--cors-origins", origin])
    assert win.server.api_key.text() == "k1"  # the tab shows the first key
    assert ask(qtbot, "GET", url + "/v1/models")[0] == 401
    for key in ("k1", "k2"):  # the second key works too, as with --headless
        auth = {"Authorization": f"Bearer {key}"}
        assert ask(qtbot, "GET", url + "/v1/models", headers=auth)[0] == 200
    st, head, _ = ask(
        qtbot, "GET", url + "/health", headers={"Origin": origin, "Authorization": "Bearer k2"}
    )
    assert st == 200 and head.get("Access-Control-Allow-Origin") == origin


def test_no_slots_and_no_webui(serve, qtbot):
    _, url = serve(["--no-slots", "--no-webui"])
    assert ask(qtbot, "GET", url + "/slots")[0] == 501
    assert ask(qtbot, "GET", url + "/")[0] == 404
    assert ask(qtbot, "GET", url + "/health")[0] == 200


def test_verbose_and_lora_init_without_apply(serve, qtbot):
    _, url = serve(["-v", "--lora-init-without-apply"])
    assert ask(qtbot, "GET", url + "/props")[2]["lora_init_without_apply"] is True
    out = ask(qtbot, "POST", url + "/completion", {"prompt": PROMPT, "n_predict": 2})[2]
    assert "__verbose" in out  # -v: llama-server's debug copy of the answer


def test_the_tab_builds_headless_settings_plus_its_own_fields(qtbot, clean_engine, tmp_path):
    """Every ServerSettings field, so a flag added later cannot be missed by the tab:
    only the fields the tab owns differ from what --headless builds."""
    from core.http import ServerSettings
    from ui.app import build_window

    flags = ["--temp", "0.1", "-n", "3", "--alias", "a,b", "--tags", "t", "--metrics"]
    flags += ["--slot-save-path", str(tmp_path), "-b", "64", "-to", "9", "--no-slots"]
    flags += ["--no-webui", "-v", "--lora-init-without-apply", "--api-key", "k1"]
    flags += ["--api-key", "k2", "--cors-origins", "http://a.example", "--port", "9999"]
    args = parse_args(flags)
    win = build_window(args, clean_engine)
    try:
        win.server.api_key.setText("mine")
        got = win.server.server_settings()
        headless = ServerSettings.from_args(args)
        own = {"host", "port", "api_keys", "on_log", "allow_runtime_lora", "lora_dirs"}
        for f in dataclasses.fields(ServerSettings):
            if f.name not in own:
                assert getattr(got, f.name) == getattr(headless, f.name), f.name
        assert (got.port, got.api_keys) == (9999, ["mine", "k2"])  # the tab's key is the first
    finally:
        win.close()
        win.deleteLater()
