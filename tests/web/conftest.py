"""The browser for the web page's tests: Debian's ``chromium`` driven by Playwright
(pinned in requirements-dev.txt), launched once per session.

Playwright's own browser download (``playwright install``) is never used: it fetches
a browser build from outside the package registries. The system's chromium is
launched instead, with background networking off (this machine's network is closed,
and chromium would otherwise keep trying to reach its services).

Without chromium (or playwright) a local run skips these tests with one line saying
so; CI (.ci/run) installs chromium and sets MIXDESK_REQUIRE_BROWSER=1, which turns
that skip into a failure: the browser tests never pass by not running.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    found = shutil.which("chromium")
    if found:
        return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def _unavailable(why: str):
    if os.environ.get("MIXDESK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests: {why} (MIXDESK_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(f"browser tests: {why}")


@pytest.fixture(scope="session")
def browser():
    exe = chromium_path()
    if exe is None:
        _unavailable("no chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("no playwright (pip install -r requirements-dev.txt)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()
