"""Help ▸ About Mixdesk names the version (pyproject.toml's, as `mixdesk --version`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

REPO = Path(__file__).resolve().parents[2]


def test_about_box_shows_the_version(window):
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    about = next(
        a
        for m in window.menuBar().actions()
        if m.menu() is not None
        for a in m.menu().actions()
        if a.text().replace("&", "") == "About Mixdesk"
    )
    seen = []

    def read_and_close():
        box = QApplication.activeModalWidget()
        assert isinstance(box, QMessageBox)
        seen.append(box.text())
        box.accept()

    QTimer.singleShot(0, read_and_close)
    about.trigger()  # the modal box runs its own loop until read_and_close accepts it
    assert seen and f"Mixdesk {want}:" in seen[0]
