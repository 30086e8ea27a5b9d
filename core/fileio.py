"""Writing a file so that no reader ever sees half of it: the one way Mixdesk replaces
a file it owns (settings, presets and chats, catalogue downloads, slot saves)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(dest: Path | str, fill: Callable[[BinaryIO], object]) -> Path:
    """Write ``dest`` through ``fill(file)`` into a hidden temporary file in the same
    folder, fsync it, then rename it over ``dest``. A reader sees the old file or the
    new one, never a torn one; a failure (a full disk, an exception in ``fill``, a
    cancel) leaves the old file as it was and no temporary file behind. The temporary
    name is unique, so two writers of one name never write into each other's file."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dest


def write_text_atomically(dest: Path | str, text: str) -> Path:
    """``write_atomically`` for UTF-8 text."""
    data = text.encode("utf-8")
    return write_atomically(dest, lambda out: out.write(data))
