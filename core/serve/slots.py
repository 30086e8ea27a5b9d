"""Slot save / restore / erase (llama-server's POST /slots/{id}?action=...).

A KV pool slot keeps the keys/values of the last sequence that ran in it
(``KVPool.resident``). ``save`` writes them to a file in --slot-save-path,
``restore`` puts a file's keys/values back into a free slot and into the prefix
cache, so the next request that starts with those tokens (under the same mix)
skips their prefill; ``erase`` forgets a slot's content.

The file is Mixdesk's own format (llama.cpp's depends on its ggml tensor layout):

    MAGIC (8 bytes) | version u32 | meta length u32 | meta (UTF-8 JSON)
    | tokens int32[n] | keys float32 (L, n_kv, n, hd) | values float32 (L, n_kv, n, hd)

``meta`` names the model (file name, size, a hash of its first MiB, the KV shape) and
the mix the keys/values were computed under (adapter paths and scales): a file of
another model, or of a mix whose adapters are not loaded, is refused with a 400.
Every read is bounded by the file's own size, so a corrupt or hostile file is a
clear error, never a huge allocation. Disk I/O runs off the engine thread; only the
copies into and out of the pool run on it (``Engine.run_on_engine``).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..fileio import write_atomically
from ..lora.mix import MixKey, mix_key
from ..model.kv_cache import KVCache
from .scheduler import SlotTask

MAGIC = b"MXDKSLOT"
VERSION = 1
_HEAD = struct.Struct("<8sII")  # magic, version, meta length
MAX_META = 1 << 20  # bytes of JSON a file may declare
IDENTITY_BYTES = 1 << 20  # the model file's first MiB (header, metadata) is hashed
# llama.cpp's fs_validate_filename: characters Windows or POSIX would refuse or reinterpret
_BAD_CHARS = set('/\\:*?"<>|') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


class SlotError(UserError):
    """A slot action the client got wrong (bad slot, file, filename): a 400."""


class SlotBusy(SlotError):
    code = 409
    type = "unavailable_error"


@dataclass
class SlotImage:
    """A slot's content: tokens with their keys/values, and the mix they were computed
    under (adapter ids of this engine)."""

    tokens: list[int]
    k: np.ndarray  # (L, n_kv, n, hd)
    v: np.ndarray  # (L, n_kv, n, hd)
    mix: MixKey


def check_filename(name) -> str:
    """llama-server's rule for slot file names: a plain name, no folders (so no path
    traversal), no control or reserved characters, no trailing dot or space."""
    if not isinstance(name, str) or not name:
        raise SlotError('"filename" must be a non-empty string')
    bad = (
        len(name.encode("utf-8", "surrogatepass")) > 255
        or name in (".", "..")
        or name[0] == " "
        or name[-1] in " ."
        or any(ord(c) <= 0x1F or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF
               or c in _BAD_CHARS for c in name)
    )  # fmt: skip
    if bad:
        raise SlotError("Invalid filename")
    return name


def slot_path(folder: Path, name) -> Path:
    """The file ``name`` inside the save folder; never outside it (a symlink included)."""
    path = folder / check_filename(name)
    if not path.resolve().is_relative_to(folder.resolve()):
        raise SlotError("Invalid filename")
    return path


def model_identity(path: Path, cfg) -> dict:
    """What ties a file to one model: a cache from another model (even of the same
    shape) would attend to keys that mean nothing to it."""
    with open(path, "rb") as f:
        head = f.read(IDENTITY_BYTES)
    return {
        "file": path.name,
        "size": path.stat().st_size,
        "sha256_head": hashlib.sha256(head).hexdigest(),
        "shape": [cfg.n_layers, cfg.n_kv_heads, cfg.head_dim],
        "vocab_size": cfg.vocab_size,
    }


def mix_to_file(mix: MixKey, adapters: list[dict]) -> list[dict]:
    if getattr(mix, "steer", ()):
        # the file format records adapters only: restored, these keys/values would be
        # served to requests without the vectors they were computed under
        raise SlotError("a slot computed under control vectors cannot be saved (not supported yet)")
    by_id = {a["id"]: a for a in adapters}
    return [{"path": by_id[aid]["path"], "name": by_id[aid]["name"], "scale": s} for aid, s in mix]


def mix_from_file(entries, adapters: list[dict]) -> MixKey:
    """The saved mix as this engine's adapter ids (matched by the adapter's file)."""
    by_path = {a["path"]: a["id"] for a in adapters}
    if not isinstance(entries, list):
        raise SlotError("invalid slot save file: its mix is not a list")
    out = []
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            raise SlotError("invalid slot save file: a mix entry has no adapter path")
        scale = e.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale):
            raise SlotError("invalid slot save file: a mix entry has no finite scale")
        if e["path"] not in by_path:
            raise SlotError(
                f"the slot was saved under adapter {e.get('name', '?')!r} ({e['path']}) at "
                f"scale {scale:g}, which is not loaded: load it to restore this slot"
            )
        out.append((by_path[e["path"]], float(scale)))
    return mix_key(out)


def write_file(path: Path, identity: dict, mix: list[dict], img: SlotImage) -> int:
    """Write a slot file atomically (core.fileio: a failed write leaves the earlier
    file of that name and no partial one); returns the bytes written."""
    n = len(img.tokens)
    meta = json.dumps({"model": identity, "mix": mix, "n_tokens": n}).encode()

    def fill(f) -> None:
        f.write(_HEAD.pack(MAGIC, VERSION, len(meta)))
        f.write(meta)
        f.write(np.asarray(img.tokens, dtype="<i4").tobytes())  # (n,)
        f.write(np.ascontiguousarray(img.k, dtype="<f4").tobytes())  # (L, n_kv, n, hd)
        f.write(np.ascontiguousarray(img.v, dtype="<f4").tobytes())

    write_atomically(path, fill)
    return path.stat().st_size


def read_file(
    path: Path, identity: dict, capacity: int
) -> tuple[dict, list[int], np.ndarray, np.ndarray, int]:
    """(meta, tokens, keys, values, bytes read) of a slot file saved from this model;
    a SlotError naming what is wrong for any other file."""
    if not path.is_file():
        raise SlotError(f"no slot save file named {path.name!r}")
    data = path.read_bytes()
    bad = f"{path.name} is not a valid Mixdesk slot save file"
    if len(data) < _HEAD.size:
        raise SlotError(f"{bad}: it is too short")
    magic, version, n_meta = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SlotError(f"{bad} (llama-server's slot files cannot be restored by Mixdesk)")
    if version != VERSION:
        raise SlotError(f"{bad}: format version {version}, this Mixdesk reads {VERSION}")
    if n_meta > MAX_META or _HEAD.size + n_meta > len(data):
        raise SlotError(f"{bad}: it is truncated or corrupt")
    try:
        meta = json.loads(data[_HEAD.size : _HEAD.size + n_meta])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SlotError(f"{bad}: its header is corrupt") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise SlotError(f"{bad}: its header is corrupt")
    saved = meta["model"]
    if saved != identity:
        raise SlotError(
            f"{path.name} was saved from another model ({saved.get('file', '?')}, "
            f"{saved.get('size', '?')} bytes); this server runs {identity['file']}"
        )
    n = meta.get("n_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SlotError(f"{bad}: its token count is invalid")
    if n > capacity:
        raise SlotError(
            f"the slot in {path.name} holds {n} tokens, more than the slot context of {capacity}"
        )
    n_layers, n_kv, hd = identity["shape"]
    kv_size = n_layers * n_kv * n * hd * 4
    p0 = _HEAD.size + n_meta
    if len(data) != p0 + 4 * n + 2 * kv_size:
        raise SlotError(f"{bad}: it is truncated or corrupt")
    tokens = np.frombuffer(data, dtype="<i4", count=n, offset=p0)  # (n,)
    if n and (tokens.min() < 0 or tokens.max() >= identity["vocab_size"]):
        raise SlotError(f"{bad}: it holds token ids outside the vocabulary")
    shape = (n_layers, n_kv, n, hd)
    k = np.frombuffer(data, dtype="<f4", count=kv_size // 4, offset=p0 + 4 * n).reshape(shape)
    v = np.frombuffer(data, dtype="<f4", count=kv_size // 4, offset=p0 + 4 * n + kv_size)
    v = v.reshape(shape)
    if not (np.isfinite(k).all() and np.isfinite(v).all()):
        raise SlotError(f"{bad}: its keys/values are not finite")
    return meta, [int(t) for t in tokens], k, v, len(data)


# -- on the engine thread (Engine.run_on_engine) ------------------------------------------


def _free_slot(sched, slot: int) -> None:
    if not sched.pool.is_free(slot):
        raise SlotBusy(f"slot {slot} is processing a request; try again when it is idle")


def take_image(sched, slot: int) -> SlotImage:
    """A copy of a free slot's content (the keys/values are copied: the slot may be
    reused as soon as this returns)."""
    _free_slot(sched, slot)
    tokens = sched.pool.resident(slot)
    n = len(tokens)
    last = sched.slot_last[slot]
    k, v = sched.pool.read(slot, n)  # (L, n_kv, n, hd) each
    return SlotImage(tokens, k, v, last.mix if last is not None and n else ())


def put_image(sched, model, slot: int, img: SlotImage) -> None:
    """Put a slot's content back: into the slot's rows, and into the prefix cache (a
    later request with these tokens under this mix reuses them)."""
    _free_slot(sched, slot)
    n = len(img.tokens)
    gen = sched.pool.load(slot, img.tokens, img.k, img.v)
    sched.slot_last[slot] = SlotTask(-1, img.mix, n, 0, 0, 0)  # a later save keeps the mix
    if n == 0:
        return
    entry = KVCache.from_state(
        model.cfg, img.tokens, img.k, img.v, origin=(slot, gen), types=sched.pool.types
    )
    sched.prefix.put(img.mix, entry)


def erase(sched, slot: int) -> int:
    """Forget a free slot's content and the prefix-cache copies made from it."""
    _free_slot(sched, slot)
    n = sched.pool.forget(slot)
    sched.slot_last[slot] = None
    sched.prefix.forget_slot(slot)
    return n


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
