"""A fast, read-only GGUF parser.

``gguf.GGUFReader`` builds a numpy view per array element and takes ~3-5 s to
open SmolLM2 because of its 49k-entry vocab arrays. We only need the metadata as
plain Python values and each tensor's raw bytes, so we parse the header with
``struct`` and read numeric arrays with a single ``np.frombuffer``. Tensor data
stays in a read-only memory map until it is dequantized.

Every malformed-file path raises :class:`GGUFError` with the file name and the
problem, never a bare ``struct.error`` or ``IndexError``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import UserError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct code, numpy dtype)
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFError(UserError):
    """A GGUF file is unreadable; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, cols): reversed from GGUF's ne[]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class _Cursor:
    __slots__ = ("buf", "pos", "name")

    def __init__(self, buf, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.name}: file is truncated or corrupt "
                f"(needs {n} bytes at offset {self.pos}, file has {len(self.buf)})"
            )

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.unpack("<I")
            n = self.unpack("<Q")
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype][1]).newbyteorder("<")
                self.need(n * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr
            if itype == _STRING:
                return self._string_array(n)
            if itype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            raise GGUFError(f"{self.name}: unknown array item type {itype}")
        raise GGUFError(f"{self.name}: unknown metadata value type {vtype}")

    def _string_array(self, n: int) -> list[str]:
        # Hot path for the vocab (49k-150k strings): local names, no method calls.
        buf, pos, out = self.buf, self.pos, []
        end = len(buf)
        unpack_from = struct.unpack_from
        append = out.append
        for _ in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)
            (ln,) = unpack_from("<Q", buf, pos)
            pos += 8
            if pos + ln > end:
                self.pos = pos
                self.need(ln)
            append(str(buf[pos : pos + ln], "utf-8", "replace"))
            pos += ln
        self.pos = pos
        return out


class GGUFFile:
    """Metadata (``.metadata``: key -> Python value or numpy array) and tensor
    infos (``.tensors``: name -> TensorInfo) of one GGUF file, memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        name = self.path.name
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{name}: file is too small to be a GGUF ({size} bytes)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mm)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{name}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, name)
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{name}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{name}: corrupt header ({n_tensors} tensors, {n_kv} keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            self.metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            tname = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise GGUFError(f"{name}: tensor {tname!r} has {n_dims} dims (corrupt)")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            raw_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(
                    f"{name}: tensor {tname!r} has unknown type id {raw_type}"
                ) from None
            infos.append((tname, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for tname, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            if shape and shape[-1] % block:
                raise GGUFError(
                    f"{name}: tensor {tname!r} row of {shape[-1]} is not a "
                    f"multiple of the {qtype.name} block size {block}"
                )
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise GGUFError(
                    f"{name}: file is truncated: tensor {tname!r} needs bytes "
                    f"{start}..{start + nbytes} but the file has {size}"
                )
            self.tensors[tname] = TensorInfo(tname, shape, qtype, start, nbytes)
        self.file_size = size

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map."""
        t = self.tensors[name]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # numpy views still reference the map; it is freed with them


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return GGUFFile(path).metadata
