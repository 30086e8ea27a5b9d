"""Persistent GUI state: settings, mix presets, recent files and conversations.

Everything lives in JSON files under :func:`core.paths.config_dir` (settings,
presets) and :func:`core.paths.data_dir` (conversations). Every write goes to a
temporary file in the same folder, is fsynced, then ``os.replace``d over the
old file, so a crash at any moment leaves either the old or the new file, never
a torn one. No Qt here: the GUI and tests both use this module directly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .paths import config_dir, data_dir

log = logging.getLogger(__name__)

MAX_RECENT = 10

DEFAULTS: dict[str, Any] = {
    "recent_models": [],
    "recent_adapters": [],
    "window_geometry": None,  # base64 of QWidget.saveGeometry()
    "window_state": None,
    "splitter_state": None,
    "server": {"host": "127.0.0.1", "port": 8080, "api_key": "", "enabled": False},
    "sampling": {
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
        "n_predict": 256,
        "repeat_penalty": 1.1,
        "seed": -1,
    },
    "system_prompt": "",
    "last_conversation": None,
    "compare": {"a": "", "b": ""},
}


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False))


def read_json(path: Path, default: Any) -> Any:
    """Read a JSON file; a missing or corrupt file gives ``default`` (and is logged)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return default


class Settings:
    """Key/value settings saved on every change (they are small)."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else config_dir()
        self.path = self.folder / "settings.json"
        self._lock = threading.Lock()
        loaded = read_json(self.path, {})
        self._data: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
        self.presets = Presets(self.folder / "presets.json")

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._data:
            return self._data[key]
        if default is not None:
            return default
        d = DEFAULTS.get(key)
        return json.loads(json.dumps(d)) if d is not None else None  # a private copy

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            atomic_write_json(self.path, self._data)

    def update(self, key: str, **fields: Any) -> dict:
        """Merge ``fields`` into the dict setting ``key`` and save."""
        cur = dict(self.get(key) or {})
        cur.update(fields)
        self.set(key, cur)
        return cur

    # -- recent files ---------------------------------------------------------------
    def add_recent(self, key: str, path: str | Path) -> list[str]:
        p = str(Path(path))
        items = [x for x in self.get(key) or [] if x != p]
        items.insert(0, p)
        self.set(key, items[:MAX_RECENT])
        return items[:MAX_RECENT]

    def recent_models(self) -> list[str]:
        return list(self.get("recent_models") or [])


class Presets:
    """Named mixes. A preset maps adapter path -> {"scale", "muted", "solo"}, so it
    survives restarts (adapter ids only live for one session)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data = read_json(self.path, {})
        self._data: dict[str, dict] = data if isinstance(data, dict) else {}

    def names(self) -> list[str]:
        return sorted(self._data, key=str.lower)

    def get(self, name: str) -> dict | None:
        p = self._data.get(name)
        return json.loads(json.dumps(p)) if p is not None else None

    def save(self, name: str, preset: dict) -> None:
        name = name.strip()
        if not name:
            raise ValueError("a preset needs a name")
        self._data[name] = preset
        self._flush()

    def rename(self, old: str, new: str) -> None:
        new = new.strip()
        if old not in self._data:
            raise KeyError(f"no preset named {old!r}")
        if not new:
            raise ValueError("a preset needs a name")
        if new != old and new in self._data:
            raise ValueError(f"a preset named {new!r} already exists")
        self._data = {(new if k == old else k): v for k, v in self._data.items()}
        self._flush()

    def delete(self, name: str) -> None:
        if self._data.pop(name, None) is not None:
            self._flush()

    def _flush(self) -> None:
        atomic_write_json(self.path, self._data)


class Conversations:
    """Saved chats: one JSON file per conversation under data_dir()/conversations."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else data_dir() / "conversations"
        self.folder.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def new(system_prompt: str = "") -> dict:
        return {
            "id": time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6],
            "title": "New chat",
            "created": time.time(),
            "updated": time.time(),
            "system_prompt": system_prompt,
            "messages": [],
        }

    def _file(self, cid: str) -> Path:
        if not re.fullmatch(r"[\w.-]+", cid):
            raise ValueError(f"bad conversation id {cid!r}")
        return self.folder / f"{cid}.json"

    def save(self, conv: dict) -> None:
        conv["updated"] = time.time()
        if conv.get("title", "New chat") == "New chat":
            first = next((m["content"] for m in conv["messages"] if m["role"] == "user"), "")
            if first:
                conv["title"] = " ".join(first.split())[:60]
        atomic_write_json(self._file(conv["id"]), conv)

    def load(self, cid: str) -> dict | None:
        conv = read_json(self._file(cid), None)
        return conv if isinstance(conv, dict) and "messages" in conv else None

    def delete(self, cid: str) -> None:
        try:
            self._file(cid).unlink()
        except FileNotFoundError:
            pass

    def list(self) -> list[dict]:
        """[{id, title, updated}] newest first."""
        out = []
        for f in self.folder.glob("*.json"):
            conv = read_json(f, None)
            if isinstance(conv, dict) and "id" in conv:
                out.append(
                    {
                        "id": conv["id"],
                        "title": conv.get("title", conv["id"]),
                        "updated": conv.get("updated", 0),
                    }
                )
        return sorted(out, key=lambda c: c["updated"], reverse=True)
