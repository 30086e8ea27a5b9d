"""Helpers the window tests share (beside conftest.py's fixtures)."""

from __future__ import annotations

import asyncio


def close_window(win, qtbot) -> None:
    """Stop a window's server, then close and delete the window (a test that makes its
    own window, on an engine of its own, closes it so too)."""
    try:
        if win.server.runner is not None:
            fut = asyncio.ensure_future(win.server.stop(remember=False))
            qtbot.waitUntil(fut.done, timeout=10000)
        win.close()
        win.deleteLater()
    except RuntimeError:  # already deleted
        pass
