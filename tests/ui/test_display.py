"""ui/display.py: a window that cannot open is reported in one line, before Qt
would abort the process with "no Qt platform plugin could be initialized"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ui import display
from ui.display import XCB_PACKAGES, display_problem, xcb_plugin_error

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "env, platform",
    [
        ({}, "darwin"),  # not Linux: Qt's own business
        ({"QT_QPA_PLATFORM": "offscreen"}, "linux"),  # a platform the user chose
        ({"WAYLAND_DISPLAY": "wayland-0"}, "linux"),  # a Wayland session
    ],
)
def test_nothing_to_report(env, platform):
    assert display_problem(env, platform) is None


def test_no_display_says_so_and_points_to_the_headless_api():
    msg = display_problem({}, "linux")
    assert "DISPLAY is not set" in msg and "make serve" in msg
    # asking Qt for X11 explicitly needs a display just the same
    assert display_problem({"QT_QPA_PLATFORM": "xcb"}, "linux") == msg


def test_a_missing_x11_library_is_named_with_the_packages_to_install(monkeypatch):
    err = "libxcb-cursor.so.0: cannot open shared object file: No such file or directory"
    monkeypatch.setattr(display, "xcb_plugin_error", lambda: err)
    msg = display_problem({"DISPLAY": ":0"}, "linux")
    assert err in msg and f"sudo apt-get install {XCB_PACKAGES}" in msg
    monkeypatch.setattr(display, "xcb_plugin_error", lambda: None)
    assert display_problem({"DISPLAY": ":0"}, "linux") is None


def test_plugin_load_errors_come_from_the_real_loader(tmp_path):
    bad = tmp_path / "libqxcb.so"
    bad.write_bytes(b"not an ELF file")
    err = xcb_plugin_error(bad)
    assert err and str(bad) in err  # the loader's own words, path included
    assert xcb_plugin_error(tmp_path / "absent.so") is None


def test_main_without_a_display_exits_with_one_line_before_loading_anything(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
    }
    env["MIXDESK_HOME"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, str(REPO / "main.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["mixdesk: error: " + display_problem({}, "linux")]
    assert "Aborted" not in r.stderr and "Traceback" not in r.stderr
