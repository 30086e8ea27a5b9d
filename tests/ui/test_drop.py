"""Dropping files on the window or the adapter panel adds the adapters to the desk."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent

# PySide6 6.12 offers only the deprecated QPoint constructor for QDragEnterEvent
pytestmark = pytest.mark.filterwarnings("ignore:Function.*QDragEnterEvent:DeprecationWarning")


def _mime(paths) -> QMimeData:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    return mime


def _drop(widget, paths) -> QDropEvent:
    mime = _mime(paths)
    enter = QDragEnterEvent(QPoint(5, 5), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    widget.dragEnterEvent(enter)
    assert enter.isAccepted()
    ev = QDropEvent(QPointF(5, 5), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    widget.dropEvent(ev)
    return ev


def test_dropping_adapters_on_the_window_and_the_panel_adds_them(window, qtbot, ref_dir):
    _drop(window, [ref_dir / "adapters" / "lora_attn.gguf"])
    qtbot.waitUntil(lambda: len(window.mixer.strips) == 1, timeout=10000)
    _drop(window.adapters, [ref_dir / "adapters" / "lora_ffn.gguf"])
    qtbot.waitUntil(lambda: len(window.mixer.strips) == 2, timeout=10000)
    assert sorted(a["name"] for a in window.engine.adapters()) == ["lora_attn", "lora_ffn"]


def test_dropping_a_non_file_is_ignored(window):
    mime = QMimeData()
    mime.setText("not a file")
    enter = QDragEnterEvent(QPoint(5, 5), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    enter.ignore()
    window.dragEnterEvent(enter)
    assert not enter.isAccepted()
