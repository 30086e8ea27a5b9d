"""The web page's tests: one engine for them all, and the browser: Debian's ``chromium`` driven by Playwright
(pinned in requirements-dev.txt), launched once per session.

Playwright's own browser download (``playwright install``) is never used: it fetches
a browser build from outside the package registries. The system's chromium is
launched instead, with background networking off (this machine's network is closed,
and chromium would otherwise keep trying to reach its services).

Without chromium (or playwright) a local run skips these tests with one line saying
so; CI (.ci/run) installs chromium and sets MIXDESK_REQUIRE_BROWSER=1, which turns
that skip into a failure: the browser tests never pass by not running.

The engine (SmolLM2 with one adapter) is shared by test_webui.py and the browser tests:
loading it and its first prefill cost seconds each time, and neither module changes it
(the page's mix goes with each request; both check the global mix stays as it was).
Their servers over it, ``srv`` (no key) and ``locked`` (the module's ``api_key``), are
here too, one of each per module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from tests.serving import running_engine, serving

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


HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def engine(smollm_path, ref_dir):
    """Session-scoped, seen by tests/web only: these modules run last in a whole run."""
    attn = ref_dir / "adapters" / "lora_attn.gguf"
    with running_engine(smollm_path, adapters=[attn], ctx_size=512, n_parallel=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def srv(engine):
    """A server over the shared engine with the defaults: the web UI on, no key."""
    with serving(engine) as s:
        yield s


@pytest.fixture(scope="module")
def locked(engine, api_key):
    """A server over the shared engine behind ``api_key``, a module-scoped fixture each
    module that uses this one defines (its own key, named in its own tests)."""
    with serving(engine, api_keys=[api_key]) as s:
        yield s


def why_unavailable() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if chromium_path() is None:
        return "no chromium (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "no playwright (pip install -r requirements-dev.txt)"
    return None


def required() -> bool:
    return os.environ.get("MIXDESK_REQUIRE_BROWSER") == "1"


def pytest_collection_modifyitems(config, items):
    """Without a browser, a local run skips these tests under one mark: pytest's
    summary then folds them into one line. CI (MIXDESK_REQUIRE_BROWSER=1) lets them
    run into the fixture, which fails them."""
    why = why_unavailable()
    if why is None or required():
        return
    mark = pytest.mark.skip(reason=f"browser tests: {why}")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(mark)


@pytest.fixture(scope="session")
def browser():
    why = why_unavailable()
    if why is not None:
        if required():
            pytest.fail(f"browser tests: {why} (MIXDESK_REQUIRE_BROWSER=1)", pytrace=False)
        pytest.skip(f"browser tests: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()
