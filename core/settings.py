"""Persistent GUI state: settings, mix presets, recent files and conversations.

Everything lives in JSON files under :func:`core.paths.config_dir` (settings,
presets) and :func:`core.paths.data_dir` (conversations). Every write goes to a
temporary file in the same folder, is fsynced, then ``os.replace``d over the
old file, so a crash at any moment leaves either the old or the new file, never
a torn one. No Qt here: the GUI and tests both use this module directly.

What is read back is never trusted: a file that cannot be parsed is moved aside
as ``NAME.corrupt-<time>`` (never overwritten) and a one-line note says so in
:attr:`Settings.problems`; each field is checked against :data:`SCHEMA` and a
field of the wrong type or out of range falls back to its own default, keeping
the others.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UserError
from .fileio import write_text_atomically
from .lora.merge import MergeSpec
from .options import DEFAULT_HOST, DEFAULT_PORT
from .paths import config_dir, data_dir
from .serve.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_RECENT = 10
THEMES = ("system", "light", "dark")  # "system" follows the desktop's colour scheme
MAX_TEXT = 1_000_000  # a system prompt or path longer than this is not a setting
SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a file name, no path, no dot-first

# -- field checks: each returns the cleaned value or raises ValueError ----------------------------


class _Bad(ValueError):
    pass


def _str(value: Any, *, empty: bool = True, max_len: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value.strip()):
        raise _Bad("not a string")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else _str(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad("not true/false")
    return value


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad("not a number")
        if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
            raise _Bad("not a whole number")
        if not lo <= int(value) <= hi:
            raise _Bad(f"not in {lo}..{hi}")
        return int(value)

    return check


def _float(lo: float, hi: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad("not a number")
        if not math.isfinite(value) or not lo <= value <= hi:
            raise _Bad(f"not in {lo:g}..{hi:g}")
        return float(value)

    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise _Bad(f"not one of {', '.join(choices)}")
        return value

    return check


def _safe_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not SAFE_ID.fullmatch(value):
        raise _Bad("not a safe file name")
    return value


def _base64(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9+/=]{0,100000}", value):
        raise _Bad("not base64")
    return value


def _str_list(max_items: int) -> Callable[[Any], list[str]]:
    def check(value: Any) -> list[str]:
        if not isinstance(value, list):
            raise _Bad("not a list")
        # one bad entry is dropped, the good ones kept
        return [v for v in value if isinstance(v, str) and v and len(v) < 4096][:max_items]

    return check


def _record(fields: dict[str, Field]) -> Callable[[Any], dict]:
    """A dict checked field by field: a bad field alone takes its default."""

    def check(value: Any) -> dict:
        if not isinstance(value, dict):
            raise _Bad("not an object")
        return {k: f.clean(value.get(k, _MISSING), k) for k, f in fields.items()}

    return check


_MISSING = object()


class Field:
    """One setting: its default and the check its stored value must pass."""

    def __init__(self, default: Any, check: Callable[[Any], Any]):
        self.default = default
        self.check = check

    def clean(self, value: Any, name: str = "") -> Any:
        if value is _MISSING:
            return _copy(self.default)
        try:
            return self.check(value)
        except (ValueError, TypeError, OverflowError) as e:
            log.warning("setting %s: %s; using the default", name or "?", e)
            return _copy(self.default)


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _desk_adapter(value: Any) -> dict:
    if not isinstance(value, dict):
        raise _Bad("not an object")
    return {
        "path": _str(value.get("path"), empty=False, max_len=4096),
        "scale": Field(0.0, _float(-2.0, 2.0)).clean(value.get("scale", 0.0), "desk scale"),
        "muted": Field(False, _bool).clean(value.get("muted", False), "desk muted"),
        "solo": Field(False, _bool).clean(value.get("solo", False), "desk solo"),
    }


def _merge(value: Any) -> dict:
    """A mix's merge method as saved ({"method", "density", ...}, core/lora/merge.py)."""
    try:
        return MergeSpec.from_dict(value).as_dict()
    except UserError as e:
        raise _Bad(str(e)) from None


LINEAR_MERGE = {"method": "linear"}


def _desk_adapters(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _Bad("not a list")
    out = []
    for item in value[:64]:
        try:
            out.append(_desk_adapter(item))
        except (ValueError, TypeError):
            log.warning("dropping a desk entry that is not an adapter")
    return out


SERVER_FIELDS = {
    "host": Field(DEFAULT_HOST, lambda v: _str(v, empty=False, max_len=255).strip()),
    "port": Field(DEFAULT_PORT, _int(1, 65535)),
    "api_key": Field("", lambda v: _str(v, max_len=4096)),
    "enabled": Field(False, _bool),
    "allow_runtime_lora": Field(False, _bool),
}
# ranges are those of the sampling form's spin boxes. The window's chat defaults differ
# from the engine's (llama-server's) on purpose where a chat reads better: a little
# cooler, a repeat penalty, a bounded reply; the filters are the engine's own.
_ENGINE = SamplingParams()
SAMPLING_FIELDS = {
    "temperature": Field(0.7, _float(0.0, 5.0)),
    "top_k": Field(_ENGINE.top_k, _int(0, 1000)),
    "top_p": Field(_ENGINE.top_p, _float(0.0, 1.0)),
    "min_p": Field(_ENGINE.min_p, _float(0.0, 1.0)),
    "n_predict": Field(256, _int(1, 32768)),
    "repeat_penalty": Field(1.1, _float(0.5, 3.0)),
    "seed": Field(-1, _int(-1, 2**31 - 1)),
}

SCHEMA: dict[str, Field] = {
    "recent_models": Field([], _str_list(MAX_RECENT)),
    "recent_adapters": Field([], _str_list(MAX_RECENT)),
    "window_geometry": Field(None, _base64),  # base64 of QWidget.saveGeometry()
    "window_state": Field(None, _base64),
    "splitter_state": Field(None, _base64),
    "tab": Field(0, _int(0, 16)),
    "server": Field({k: f.default for k, f in SERVER_FIELDS.items()}, _record(SERVER_FIELDS)),
    "sampling": Field({k: f.default for k, f in SAMPLING_FIELDS.items()}, _record(SAMPLING_FIELDS)),
    "system_prompt": Field("", _str),
    "last_conversation": Field(None, _safe_id),
    "compare": Field(
        {"a": "", "b": ""},
        _record(
            {
                "a": Field("", lambda v: _str(v, max_len=256)),
                "b": Field("", lambda v: _str(v, max_len=256)),
            }
        ),
    ),
    "export_dir": Field(None, _opt_str),
    "preset": Field("", lambda v: _str(v, max_len=256)),  # the desk's selected preset
    "theme": Field("system", _one_of(THEMES)),  # the View menu's Light / Dark / System
    "unity": Field(False, _bool),  # View → Unity faders: the desk in effective units
    # the mixing desk as the user left it: adapters and control vectors by path, with
    # their fader and buttons
    "desk": Field(
        {"bypass": False, "adapters": []},
        _record(
            {
                "bypass": Field(False, _bool),
                "adapters": Field([], _desk_adapters),
                # the control vectors' strips, by path, as the adapters' (#37)
                "vectors": Field([], _desk_adapters),
                "merge": Field(LINEAR_MERGE, _merge),  # how the mix combines (#21)
            }
        ),
    ),
}
DEFAULTS: dict[str, Any] = {k: f.default for k, f in SCHEMA.items()}


# -- files ------------------------------------------------------------------------------------------


def atomic_write_json(path: Path, obj: Any) -> None:
    write_text_atomically(path, json.dumps(obj, indent=2, ensure_ascii=False))


class Unreadable(Exception):
    """A file exists but does not hold what it should (its reason is one line)."""


def read_json(path: Path, default: Any) -> Any:
    """Read a JSON file; a missing or corrupt file gives ``default`` (and is logged)."""
    try:
        return load_json(path, default)
    except Unreadable as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return default


def load_json(path: Path, default: Any, kind: type | None = None) -> Any:
    """A JSON file's value; ``default`` when it does not exist. Raises :class:`Unreadable`
    when it exists but is not JSON (or not of type ``kind``)."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except IsADirectoryError:
        raise Unreadable("it is a folder, not a file") from None
    except UnicodeDecodeError:
        raise Unreadable("it is not UTF-8 text") from None
    except ValueError as e:
        raise Unreadable(f"it is not valid JSON ({str(e).split(':')[0]})") from None
    except OSError as e:
        raise Unreadable(e.strerror or type(e).__name__) from None
    if kind is not None and not isinstance(value, kind):
        raise Unreadable(f"it holds a JSON {type(value).__name__}, not an object")
    return value


def move_aside(path: Path) -> Path | None:
    """Rename an unreadable file to ``NAME.corrupt-<time>`` (never over another one);
    None when even that fails."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(100):
        target = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n else ""))
        if target.exists():
            continue
        try:
            os.rename(path, target)
        except OSError as e:
            log.warning("could not move %s aside: %s", path, e)
            return None
        return target
    return None


def _recover(path: Path, reason: str, what: str) -> tuple[str, bool]:
    """Move an unreadable file aside; the note for the user, and whether it may be written."""
    kept = move_aside(path)
    if kept is not None:
        note = f"{path.name} could not be read ({reason}); it was kept as {kept.name} and {what}"
        log.warning("%s (%s)", note, kept)
        return note, True
    note = (
        f"{path.name} could not be read ({reason}) nor moved aside; {what}, "
        "and it will not be overwritten"
    )
    log.warning(note)
    return note, False


class Settings:
    """Key/value settings saved on every change (they are small). Every read goes
    through :data:`SCHEMA`, so a caller gets a value of the right type or the default."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else config_dir()
        self.path = self.folder / "settings.json"
        self._lock = threading.Lock()
        self.problems: list[str] = []  # one line per file that could not be read
        self._writable = True
        try:
            loaded = load_json(self.path, {}, dict)
        except Unreadable as e:
            note, self._writable = _recover(self.path, str(e), "defaults are used")
            self.problems.append(note)
            loaded = {}
        self._data: dict[str, Any] = {
            k: (SCHEMA[k].clean(v, k) if k in SCHEMA else v) for k, v in loaded.items()
        }
        self.presets = Presets(self.folder / "presets.json")
        self.problems += self.presets.problems

    def get(self, key: str, default: Any = None) -> Any:
        field = SCHEMA.get(key)
        if key in self._data:
            value = self._data[key]
            return field.clean(_copy(value), key) if field else value
        if default is not None:
            return default
        return _copy(field.default) if field else None  # a private copy

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            if not self._writable:
                return
            try:
                atomic_write_json(self.path, self._data)
            except OSError as e:  # a full disk must not take the window down
                log.warning("could not save %s: %s", self.path, e)

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


def _preset(value: Any) -> dict:
    """A preset: {"bypass": bool, "adapters": {path: {name, scale, muted, solo}},
    "merge": {"method", ...}, "vectors": {path: {name, scale, muted, solo}}}; a preset
    saved before merge methods is linear, one saved before control vectors has none
    (no "vectors" key: the desk's vector strips go to 0 when it loads)."""
    if not isinstance(value, dict):
        raise _Bad("not an object")
    preset = {
        "bypass": Field(False, _bool).clean(value.get("bypass", False)),
        "adapters": _preset_entries(value, "adapters"),
        "merge": Field(LINEAR_MERGE, _merge).clean(value.get("merge", _MISSING), "preset merge"),
    }
    if "vectors" in value:
        preset["vectors"] = _preset_entries(value, "vectors")
    return preset


def _preset_entries(value: dict, key: str) -> dict:
    """A preset's strips of one kind ("adapters" or "vectors"): path -> channel."""
    entries = value.get(key, {})
    if not isinstance(entries, dict):
        raise _Bad(f"its {key} are not an object")
    out = {}
    for path, e in entries.items():
        if not isinstance(e, dict):
            continue
        out[path] = {
            "name": Field("", _str).clean(e.get("name", ""), "preset name"),
            "scale": Field(0.0, _float(-2.0, 2.0)).clean(e.get("scale", 0.0), "preset scale"),
            "muted": Field(False, _bool).clean(e.get("muted", False), "preset muted"),
            "solo": Field(False, _bool).clean(e.get("solo", False), "preset solo"),
        }
    return out


MAX_PRESET_NAME = 256  # as the "preset" setting
MAX_PRESET_FILE = 4 * 1024 * 1024  # an exported file of 1000 presets is far smaller
MAX_IMPORTED = 1000


def _strict_preset(name: Any, value: Any) -> dict:
    """An imported preset, checked strictly: where the loader of ``presets.json`` keeps
    what it can, a file from elsewhere with any wrong field is refused (UserError)."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_PRESET_NAME:
        raise UserError(f"a preset name must be 1 to {MAX_PRESET_NAME} characters")
    where = f"preset {name!r}"
    if not isinstance(value, dict):
        raise UserError(f"{where} is not an object")
    if not isinstance(value.get("bypass", False), bool):
        raise UserError(f"{where}: bypass is not true/false")
    for key, kind in (("adapters", "adapter"), ("vectors", "control vector")):
        _strict_entries(where, value.get(key, {}), key, kind)
    if "merge" in value:
        try:
            _merge(value["merge"])
        except (ValueError, TypeError) as err:
            raise UserError(f"{where}: merge: {err}") from None
    return _preset(value)


def _strict_entries(where: str, entries: Any, key: str, kind: str) -> None:
    """An imported preset's "adapters" or "vectors", checked strictly (UserError)."""
    if not isinstance(entries, dict):
        raise UserError(f"{where}: its {key} are not an object (path -> settings)")
    for path, e in entries.items():
        if not path or len(path) > 4096 or not isinstance(e, dict):
            raise UserError(f"{where}: {kind} {path[:80]!r} is not a path with settings")
        scale = e.get("scale", 0.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise UserError(f"{where}: the scale of {path[:80]!r} is not a number")
        if not (math.isfinite(scale) and -2.0 <= scale <= 2.0):
            raise UserError(f"{where}: the scale of {path[:80]!r} is not in -2..2")
        for key in ("muted", "solo"):
            if not isinstance(e.get(key, False), bool):
                raise UserError(f"{where}: {key} of {path[:80]!r} is not true/false")
        if not isinstance(e.get("name", ""), str) or len(e.get("name", "")) > MAX_PRESET_NAME:
            raise UserError(f"{where}: the name of {path[:80]!r} is not a short text")


def read_presets_file(path: Path) -> dict[str, dict]:
    """The presets in an exported file (the shape of ``presets.json``: name -> preset),
    all checked; raises UserError naming the first thing wrong, so nothing is half read."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PRESET_FILE:
            raise UserError(
                f"{path.name} is over {MAX_PRESET_FILE // 2**20} MB: not a presets file"
            )
        data = load_json(path, None, dict)
    except Unreadable as e:
        raise UserError(f"{path.name} is not a presets file: {e}") from None
    except OSError as e:
        raise UserError(f"{path.name} could not be read: {e.strerror or e}") from None
    if data is None:
        raise UserError(f"{path.name} does not exist")
    if len(data) > MAX_IMPORTED:
        raise UserError(f"{path.name} holds {len(data)} presets (at most {MAX_IMPORTED})")
    return {name.strip(): _strict_preset(name, p) for name, p in data.items()}


def free_name(name: str, taken: Any) -> str:
    """``name``, or "name (2)", "name (3)"… whichever is not in ``taken``."""
    n, out = 2, name
    while out in taken:
        out, n = f"{name} ({n})", n + 1
    return out


class Presets:
    """Named mixes. A preset maps adapter path -> {"scale", "muted", "solo"}, so it
    survives restarts (adapter ids only live for one session)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.problems: list[str] = []
        self._writable = True
        try:
            data = load_json(self.path, {}, dict)
        except Unreadable as e:
            note, self._writable = _recover(self.path, str(e), "no presets are loaded")
            self.problems.append(note)
            data = {}
        self._data: dict[str, dict] = {}
        for name, preset in data.items():
            try:
                self._data[name] = _preset(preset)
            except ValueError as e:
                log.warning("dropping preset %r: %s", name, e)

    def names(self) -> list[str]:
        return sorted(self._data, key=str.lower)

    def get(self, name: str) -> dict | None:
        p = self._data.get(name)
        return json.loads(json.dumps(p)) if p is not None else None

    def save(self, name: str, preset: dict) -> None:
        name = name.strip()
        if not name:
            raise UserError("a preset needs a name")
        self._data[name] = preset
        self._flush()

    def rename(self, old: str, new: str) -> None:
        new = new.strip()
        if old not in self._data:
            raise UserError(f"no preset named {old!r}")
        if not new:
            raise UserError("a preset needs a name")
        if new != old and new in self._data:
            raise UserError(f"a preset named {new!r} already exists")
        self._data = {(new if k == old else k): v for k, v in self._data.items()}
        self._flush()

    def delete(self, name: str) -> None:
        if self._data.pop(name, None) is not None:
            self._flush()

    def export(self, path: Path, names: list[str]) -> list[str]:
        """Write ``names`` to ``path`` as presets.json holds them (so either file imports)."""
        names = [n for n in names if n in self._data]
        atomic_write_json(Path(path), {n: self._data[n] for n in names})
        return names

    def merge(self, incoming: dict[str, dict], decide: Callable[[str], str]) -> list[str]:
        """Add ``incoming`` (from :func:`read_presets_file`). On a name clash ``decide(name)``
        says "replace", "rename" (keep both: "name (2)") or "skip". The names written."""
        added = []
        for name, preset in incoming.items():
            if name in self._data:
                choice = decide(name)
                if choice == "skip":
                    continue
                if choice == "rename":
                    name = free_name(name, self._data)
            self._data[name] = preset
            added.append(name)
        if added:
            self._flush()
        return added

    def _flush(self) -> None:
        if self._writable:
            atomic_write_json(self.path, self._data)


ROLES = ("user", "assistant")


MAX_FORK_DEPTH = 100  # forks stored inside forks: far more than anyone makes, well short of
# the recursion limit


def _message(value: Any, depth: int = 0) -> dict:
    if not isinstance(value, dict) or value.get("role") not in ROLES:
        raise _Bad("not a user or assistant message")
    msg = {"role": value["role"], "content": Field("", _str).clean(value.get("content", ""))}
    meta = value.get("meta")
    if msg["role"] == "assistant" and isinstance(meta, dict):
        msg["meta"] = _meta(meta)
    versions = value.get("versions")
    if msg["role"] == "assistant" and isinstance(versions, list) and versions:
        # a regenerated reply keeps its earlier versions (the window's ‹ 2/3 ›)
        msg["versions"] = [
            {
                "content": Field("", _str).clean(v.get("content", ""), "version content"),
                "meta": _meta(v["meta"]) if isinstance(v.get("meta"), dict) else None,
            }
            for v in versions
            if isinstance(v, dict)
        ]
        shown = Field(0, _int(0, 2**31)).clean(value.get("version", 0), "version")
        msg["version"] = min(shown, len(msg["versions"]) - 1)
    if msg["role"] == "user" and isinstance(value.get("branches"), list):
        _branches(msg, value, depth)
    return msg


def _branches(msg: dict, value: dict, depth: int) -> None:
    """A fork's other paths (core.conversation): each a list of messages starting with
    a user message; the shown one is None (it is the rest of the chat's messages)."""
    raw = value["branches"]
    shown = Field(0, _int(0, 2**31)).clean(value.get("branch", 0), "branch")
    shown = min(shown, max(len(raw) - 1, 0))
    out: list = []
    for j, tail in enumerate(raw):
        if j == shown:
            out.append(None)
        elif isinstance(tail, list) and depth < MAX_FORK_DEPTH:
            kept = _messages(tail, depth + 1)
            if kept and kept[0]["role"] == "user":
                out.append(kept)
    if len(out) > 1:
        msg["branches"], msg["branch"] = out, out.index(None)


def _messages(values: list, depth: int = 0, cid: str = "") -> list[dict]:
    out = []
    for m in values:
        try:
            out.append(_message(m, depth))
        except ValueError:
            log.warning("conversation %s: dropping a message that is not one", cid)
    return out


def _meta(meta: dict) -> dict:
    out = {
        "tokens": Field(0, _int(0, 2**31)).clean(meta.get("tokens", 0), "meta tokens"),
        "tps": Field(0.0, _float(0.0, 1e9)).clean(meta.get("tps", 0.0), "meta tps"),
        "mix": Field("", _str).clean(meta.get("mix", ""), "meta mix"),
        "stop": Field(None, _opt_str).clean(meta.get("stop"), "meta stop"),
    }
    if isinstance(meta.get("mix_ids"), list):
        out["mix_ids"] = meta["mix_ids"]
    if "context" in meta:  # tokens of the context the chat used with this reply
        out["context"] = Field(0, _int(0, 2**31)).clean(meta["context"], "meta context")
    return out


def clean_conversation(conv: dict, cid: str) -> dict:
    """A conversation with every field of the right type; its id is its file name."""
    out = {
        "id": cid,
        "title": Field("New chat", lambda v: _str(v, empty=False, max_len=500)).clean(
            conv.get("title", "New chat"), "title"
        ),
        "created": Field(0.0, _float(0.0, 1e12)).clean(conv.get("created", 0.0), "created"),
        "updated": Field(0.0, _float(0.0, 1e12)).clean(conv.get("updated", 0.0), "updated"),
        "system_prompt": Field(None, _opt_str).clean(conv.get("system_prompt"), "system_prompt"),
        "messages": [],
    }
    msgs = conv.get("messages", [])
    if isinstance(msgs, list):
        out["messages"] = _messages(msgs, cid=cid)
    else:
        log.warning("conversation %s: its messages are not a list", cid)
    return out


class Conversations:
    """Saved chats: one JSON file per conversation under data_dir()/conversations."""

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder else data_dir() / "conversations"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.problems: list[str] = []  # files moved aside since the last look

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
        if not isinstance(cid, str) or not SAFE_ID.fullmatch(cid):
            raise ValueError(f"bad conversation id {cid!r}")
        return self.folder / f"{cid}.json"

    def save(self, conv: dict) -> None:
        conv["updated"] = time.time()
        if conv.get("title", "New chat") == "New chat":
            first = next((m["content"] for m in conv["messages"] if m["role"] == "user"), "")
            if first:
                conv["title"] = " ".join(first.split())[:60]
        atomic_write_json(self._file(conv["id"]), conv)

    def _read(self, f: Path) -> dict | None:
        """A conversation file, cleaned; an unreadable one is moved aside and noted."""
        try:
            conv = load_json(f, None, dict)
        except Unreadable as e:
            note, _ = _recover(f, str(e), "that chat is not listed")
            self.problems.append(note)
            return None
        return None if conv is None else clean_conversation(conv, f.stem)

    def load(self, cid: str) -> dict | None:
        if not isinstance(cid, str) or not SAFE_ID.fullmatch(cid):
            return None
        return self._read(self._file(cid))

    def delete(self, cid: str) -> None:
        try:
            self._file(cid).unlink()
        except FileNotFoundError:
            pass

    def list(self) -> list[dict]:
        """[{id, title, updated}] newest first."""
        out = []
        for f in self.folder.glob("*.json"):
            if not SAFE_ID.fullmatch(f.stem):
                continue
            conv = self._read(f)
            if conv is not None:
                out.append({"id": conv["id"], "title": conv["title"], "updated": conv["updated"]})
        return sorted(out, key=lambda c: c["updated"], reverse=True)

    def take_problems(self) -> list[str]:
        out, self.problems = self.problems, []
        return out
