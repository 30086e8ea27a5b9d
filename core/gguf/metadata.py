"""A GGUF's metadata with its exact value types, for copying it into another file.

The merged-model export (core/lora/export.py) writes every key of the base model
again; llama.cpp checks some keys' types, so each key keeps the type it was read
with (an int32 stays an int32), which GGUFFile.metadata (plain Python values) loses.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from .reader import _Cursor


def typed_metadata(path: Path) -> list[tuple[str, int, int | None, Any]]:
    """Every metadata KV of a GGUF as (key, value type, array item type, value),
    in file order, so a copy keeps the exact types llama.cpp expects."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            cur = _Cursor(buf, path.name)
            cur.pos = 8  # magic + version
            cur.unpack("<Q")  # n_tensors
            n_kv = cur.unpack("<Q")
            out = []
            for _ in range(n_kv):
                key = cur.string()
                vtype = cur.unpack("<I")
                sub = (
                    struct.unpack_from("<I", buf, cur.pos)[0]
                    if vtype == GGUFValueType.ARRAY
                    else None
                )
                out.append((key, vtype, sub, cur.value(vtype)))
        finally:
            del cur
            buf.release()
    return out


def writable_value(vtype: int, val: Any) -> Any:
    """A value as read by typed_metadata, in the form GGUFWriter.add_key_value takes."""
    if vtype != GGUFValueType.ARRAY:
        return val
    if isinstance(val, np.ndarray):
        return val.tolist()
    return list(val)
