"""``python main.py --headless`` as a subprocess: flags, /health, the request log."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOG_LINE = re.compile(r"mixdesk\.http: (GET|POST) (/\S*) (\d{3}) (\d+\.\d) ms$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(r, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start(args):
    return subprocess.Popen(
        [sys.executable, "main.py", "--headless", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_healthy(proc, port, timeout=120.0) -> list[int]:
    seen = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.communicate()[1]}")
        try:
            st, _ = http(port, "GET", "/health")
            seen.append(st)
            if st == 200:
                return seen
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


def stop(proc) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


@pytest.fixture()
def adapter(ref_dir):
    return str(ref_dir / "adapters" / "lora_attn.gguf")


def test_headless_serves_logs_one_line_per_request_without_prompt(smollm_path, adapter):
    port = free_port()
    proc = start(
        [
            "-m",
            str(smollm_path),
            "--port",
            str(port),
            "-c",
            "256",
            "-np",
            "2",
            "--lora",
            adapter,
            "--lora-init-without-apply",
            "-ngl",
            "99",
        ]
    )
    try:
        statuses = wait_healthy(proc, port)
        assert set(statuses) <= {200, 503}
        st, ads = http(port, "GET", "/lora-adapters")
        assert st == 200 and [a["scale"] for a in ads] == [0.0]  # init without apply
        st, out = http(
            port, "POST", "/completion", {"prompt": "TOPSECRET prompt words", "n_predict": 2}
        )
        assert st == 200 and out["tokens_predicted"] == 2
        st, out = http(port, "POST", "/completion", {"prompt": "TOPSECRET", "lora": "x"})
        assert st == 400
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert "TOPSECRET" not in err
    assert "-ngl ignored" in err  # GPU flag: a notice
    assert "WARNING" not in err  # loopback: no warning
    lines = [m.groups() for m in map(LOG_LINE.search, err.splitlines()) if m]
    requests = [(m, p, s) for m, p, s, _ in lines if p != "/health"]
    assert requests == [
        ("GET", "/lora-adapters", "200"),
        ("POST", "/completion", "200"),
        ("POST", "/completion", "400"),
    ]
    assert any(p == "/health" and s == "200" for _, p, s, _ in lines)


def test_headless_verbose_logs_prompt_and_warns_on_exposure(smollm_path):
    port = free_port()
    proc = start(
        [
            "-m",
            str(smollm_path),
            "--port",
            str(port),
            "--host",
            "0.0.0.0",
            "-c",
            "128",
            "-np",
            "1",
            "--verbose",
        ]
    )
    try:
        wait_healthy(proc, port)
        st, _ = http(port, "POST", "/completion", {"prompt": "VISIBLE prompt", "n_predict": 1})
        assert st == 200
    finally:
        err = stop(proc)
    assert "VISIBLE prompt" in err
    assert "every network interface" in err and "no --api-key" in err


def test_unknown_flag_is_a_clear_error():
    r = subprocess.run(
        [sys.executable, "main.py", "--headless", "--no-such-flag"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


def test_bad_model_exits_with_one_line_error(tmp_path):
    bad = tmp_path / "nope.gguf"
    bad.write_bytes(b"not a gguf")
    r = subprocess.run(
        [sys.executable, "main.py", "--headless", "-m", str(bad), "--port", str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "mixdesk: error:" in r.stderr
    assert "Traceback" not in r.stderr
