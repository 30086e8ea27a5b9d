"""A fast, read-only GGUF parser.

``gguf.GGUFReader`` builds a numpy view per array element and takes ~3-5 s to
open SmolLM2 because of its 49k-entry vocab arrays. We only need the metadata as
plain Python values and each tensor's raw bytes, so we parse the header with
``struct`` and read numeric arrays with a single ``np.frombuffer``. Tensor data
stays in a read-only memory map until it is dequantized, or until
:meth:`GGUFFile.read_into_memory` copies it into anonymous memory (what a model's
quantized matrices are served from: see that method for why).

Every malformed-file path raises :class:`GGUFError` with the file name and the
problem, never a bare ``struct.error`` or ``IndexError``. The parser trusts no
count or size in the file: each is checked against the bytes that are actually
left before anything is allocated or looped over, and no message echoes the
file's bytes (it may be any file the user picked, even a secret one).
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import UserError
from ..memory import anonymous

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16  # llama.cpp only needs a power of two; anything larger is corrupt
MAX_NESTING = 8  # arrays of arrays; gguf-py writes them, llama.cpp reads none
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM_SIZE = 1 << 40  # elements along one dimension; more is a corrupt header
# read_into_memory: the copy starts on a 2 MB boundary (x86-64's transparent huge
# page), and the file is read this many bytes between progress steps
HUGE_PAGE = 2 << 20
READ_CHUNK = 64 << 20
# read_into_memory reads its parts on this many threads at most: the time goes to the
# kernel's zeroing and copying of pages, which runs on the reading thread's core (a
# 1B's 0.8 GB: 0.26-0.95 s on one thread, 0.15-0.29 on two, alternating processes)
READ_THREADS = 4

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


class UnsupportedQuant(GGUFError):
    """A tensor whose quant type cannot be dequantized here."""

    def __init__(self, file: str, tensor: str, qtype: GGMLQuantizationType):
        super().__init__(
            f"{file}: tensor {short_name(tensor)} uses quant type {qtype.name}, "
            "which cannot be dequantized"
        )
        self.tensor, self.qtype = tensor, qtype


def check_regular_file(
    path: str | os.PathLike, error: type[UserError] = UserError, prefix: str = ""
) -> int:
    """Refuse anything but a regular file before opening it, and return its size.

    open() on a FIFO blocks until a writer appears (forever, for a file picker), and
    reading a device or a directory as a model is never what the user meant.
    ``prefix`` starts the message (e.g. "adapter foo: ").
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise error(f"{prefix}{p}: cannot open ({e.strerror or 'not accessible'})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{prefix}{p.name} is not a regular file (it is {_file_kind(st.st_mode)})")
    return st.st_size


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a file"


def short_name(text: str | None, limit: int = 60) -> str:
    """A key or tensor name from the file, quoted and cut short for a message. A name
    that is not printable ASCII is corrupt (or hostile): it is not shown at all."""
    if text is None:
        return "None"
    if not (isinstance(text, str) and text.isascii() and text.isprintable()):
        return "(unreadable name)"
    return repr(text if len(text) <= limit else text[:limit] + "...")


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
            raise self.corrupt()

    def left(self) -> int:
        return len(self.buf) - self.pos

    def corrupt(self, why: str = "") -> GGUFError:
        """The one message for a file whose counts or sizes run past its end; it
        names no byte counts, which for a corrupt file are meaningless 20-digit values."""
        return GGUFError(
            f"{self.name} is not a valid GGUF file: it is truncated or corrupt"
            + (f" ({why})" if why else "")
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

    def value(self, vtype: int, key: str = "", depth: int = 0) -> Any:
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
                self.need(n * 8)  # every string has at least its 8-byte length
                return self._string_array(n)
            if itype == _ARRAY:
                if depth >= MAX_NESTING:
                    raise GGUFError(
                        f"{self.name} is not a valid GGUF file: metadata key "
                        f"{short_name(key)} has arrays nested more than {MAX_NESTING} deep"
                    )
                self.need(n * 12)  # every array has at least its type and count
                return [self.value(_ARRAY, key, depth + 1) for _ in range(n)]
            raise GGUFError(
                f"{self.name} is not a valid GGUF file: metadata key {short_name(key)} "
                f"has an unknown array item type {itype}"
            )
        raise GGUFError(
            f"{self.name} is not a valid GGUF file: metadata key {short_name(key)} "
            f"has an unknown value type {vtype}"
        )

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
        check_regular_file(self.path, GGUFError)
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{name} is not a valid GGUF file: it is too small ({size} bytes)")
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:  # ENOMEM: no address space left (ulimit -v, 32-bit)
                raise GGUFError(
                    f"{name}: not enough memory to open it: mapping the file needs "
                    f"{byte_size(size)} of address space ({e.strerror or e})"
                ) from None
        buf = memoryview(self._mm)
        if bytes(buf[:4]) != GGUF_MAGIC:
            # never show the bytes: the user may have picked any file, even a secret one
            raise GGUFError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
        cur = _Cursor(buf, name)
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{name}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        # each key takes >= 12 bytes (length, type) and each tensor info >= 24
        if n_kv * 12 + n_tensors * 24 > cur.left():
            raise cur.corrupt(
                f"the header declares {_count(n_kv)} keys and {_count(n_tensors)} tensors"
            )
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            if key in self.metadata:
                raise GGUFError(
                    f"{name} is not a valid GGUF file: duplicate metadata key {short_name(key)}"
                )
            self.metadata[key] = cur.value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            tname = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > MAX_DIMS:
                raise GGUFError(
                    f"{name} is not a valid GGUF file: tensor {short_name(tname)} "
                    f"has {_count(n_dims)} dimensions"
                )
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            raw_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(
                    f"{name}: tensor {short_name(tname)} has unknown type id {_count(raw_type)}"
                ) from None
            infos.append((tname, tuple(reversed(dims)), qtype, offset))
        align = self._alignment()
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for tname, shape, qtype, offset in infos:
            self.tensors[tname] = self._tensor_info(tname, shape, qtype, offset, data_start, size)
        self.file_size = size
        # read_into_memory's copy of the file's bytes [_held_from, file_size), or None
        self._held: np.ndarray | None = None
        self._held_from = 0

    def _alignment(self) -> int:
        """general.alignment: llama.cpp requires a nonzero power of two (a uint32)."""
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(align, int)
            or isinstance(align, bool)
            or not 0 < align <= MAX_ALIGNMENT
            or align & (align - 1)
        ):
            raise GGUFError(
                f"{self.path.name} is not a valid GGUF file: general.alignment must be a "
                f"power of two up to {MAX_ALIGNMENT}, not {_short_value(align)}"
            )
        return align

    def _tensor_info(
        self, tname: str, shape: tuple[int, ...], qtype, offset: int, data_start: int, size: int
    ) -> TensorInfo:
        """Check one tensor's shape and place: its data must lie inside the file."""
        name = self.path.name
        if tname in self.tensors:
            raise GGUFError(
                f"{name} is not a valid GGUF file: duplicate tensor {short_name(tname)}"
            )
        if any(d > MAX_DIM_SIZE for d in shape):
            raise GGUFError(
                f"{name} is not a valid GGUF file: tensor {short_name(tname)} has an absurd size"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = math.prod(shape)
        if shape and shape[-1] % block:
            raise GGUFError(
                f"{name}: the rows of tensor {short_name(tname)} are not a "
                f"multiple of the {qtype.name} block size {block}"
            )
        nbytes = n // block * type_size
        start = data_start + offset
        if offset % self._alignment() or start + nbytes > size:
            raise GGUFError(
                f"{name} is not a valid GGUF file: it is truncated or corrupt (the data of "
                f"tensor {short_name(tname)} lies outside the file)"
            )
        return TensorInfo(tname, shape, qtype, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map, or into
        the copy in memory once read_into_memory has run."""
        t = self.tensors[name]
        if self._held is not None:
            a = t.offset - self._held_from
            return self._held[a : a + t.nbytes]
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    @property
    def data_bytes(self) -> int:
        """The bytes from the first tensor's data to the end of the file: what
        read_into_memory copies."""
        return self.file_size - self._data_from()

    @property
    def in_memory(self) -> bool:
        """True once read_into_memory has run: raw() views the copy."""
        return self._held is not None

    def _data_from(self) -> int:
        return min((t.offset for t in self.tensors.values()), default=self.file_size)

    def read_into_memory(self, step: Callable[[float], None] | None = None) -> None:
        """Copy the tensor data out of the file into anonymous memory, read() by
        read() on up to READ_THREADS threads, advised for transparent huge pages; raw()
        returns views of the copy from then on (read-only, as before; the same layout,
        so tensors that lie back to back still do). ``step(fraction done)`` runs on the
        calling thread while the copy is made and may raise to stop it (the copy is
        then dropped). GGUFError if the file cannot be read or has become shorter
        since it was opened; MemoryError if no memory.

        Why: the compiled kernels stream a decode step's weights faster than the
        file's 4 KB pages translate. A 1B-shaped Q4_K_M decoded at 15.6-15.7 tok/s
        from the map and 18.7-18.9 from this copy (2 threads, same processes
        alternating, 2026-12-07; its 215 MB Q6_K output matrix alone: 13.1 -> 16.4
        GB/s); the 3B and 8B shapes as fast either way (the caller decides: weights.py's
        read_or_map). read(), not a copy from the map: a page copied from the map would be
        counted twice in the process's RSS while the copy is made."""
        if self._held is not None:
            return
        start = self._data_from()
        n = self.file_size - start
        try:
            buf = anonymous(n + HUGE_PAGE, huge_pages=True)
        except OSError as e:  # ENOMEM: no address space left
            raise MemoryError(f"cannot reserve {byte_size(n)} ({e.strerror or e})") from None
        whole = np.frombuffer(buf, dtype=np.uint8)  # (n + HUGE_PAGE,)
        pad = -whole.ctypes.data % HUGE_PAGE
        held = whole[pad : pad + n]  # (n,) the file's bytes [start, file_size)
        _read_parts(self.path, start, held, step)
        held.flags.writeable = False
        self._held, self._held_from = held, start

    def dequantize(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``name`` as float32 in its numpy shape, or only its rows [a, b) with
        ``rows=(a, b)`` (a quantized row is whole blocks, so a run of rows is one run
        of bytes; a big tensor then dequantizes in pieces, for progress and memory).
        A quant type gguf-py cannot dequantize (some K-quants, say) raises
        UnsupportedQuant naming file, tensor, type."""
        t = self.tensors[name]
        raw, shape = self.raw(name), t.shape
        if rows is not None:
            a, b = rows
            if not (len(shape) >= 2 and 0 <= a <= b <= shape[0]):
                raise ValueError(f"rows {rows} out of range for {name} {shape}")
            row_bytes = t.nbytes // shape[0]
            raw, shape = raw[a * row_bytes : b * row_bytes], (b - a, *shape[1:])
        try:
            data = quants.dequantize(raw, t.qtype)
        except NotImplementedError:
            raise UnsupportedQuant(self.path.name, name, t.qtype) from None
        return data.reshape(shape)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # numpy views still reference the map; it is freed with them


def byte_size(n_bytes: int) -> str:
    """A size for a message: "7.93 GB", "512 MB"."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.0f} MB"


def _count(n: int) -> str:
    """A number read from a file, for a message: absurd ones are not spelled out."""
    return str(n) if n < 10**12 else "an absurd number of"


def _short_value(v: Any) -> str:
    """A metadata value for a message: numbers as they are, anything else by kind."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return {str: "a string", bool: "a boolean"}.get(type(v), "an array")
    return str(v) if abs(v) < 1e12 or not math.isfinite(v) else f"{v:.3g}"


def _read_parts(path: Path, start: int, held: np.ndarray, step: Callable[[float], None] | None):
    """The file's bytes [start, start + len(held)) read into ``held``, in parts of whole
    huge pages on up to READ_THREADS threads (a file of its own each), READ_CHUNK a
    read(). ``step(fraction done)`` runs on the calling thread while they read, and may
    raise to stop them (the exception is raised once they have stopped); a read error
    or a file that became shorter is a GGUFError."""
    n = len(held)
    k = max(1, min(READ_THREADS, os.cpu_count() or 1, -(-n // READ_CHUNK)))
    per = -(-n // k // HUGE_PAGE) * HUGE_PAGE  # each part whole huge pages, but the last
    bounds = [(a, min(n, a + per)) for a in range(0, n, per)]
    done = [0] * len(bounds)  # bytes read of each part
    stop = threading.Event()
    errors: list[BaseException] = []

    def read(i: int, a: int, b: int) -> None:
        try:
            with open(path, "rb", buffering=0) as f, memoryview(held) as view:
                f.seek(start + a)
                at = a
                while at < b and not stop.is_set():
                    got = f.readinto(view[at : min(b, at + READ_CHUNK)])
                    if not got:
                        raise GGUFError(
                            f"{path.name} became shorter while it was being read "
                            f"({byte_size(start + at)} of {byte_size(start + n)})"
                        )
                    at += got
                    done[i] = at - a
        except OSError as e:
            errors.append(GGUFError(f"{path}: cannot read ({e.strerror or e})"))
        except BaseException as e:  # noqa: BLE001 — handed to the calling thread
            errors.append(e)
        if errors:
            stop.set()

    workers = [
        threading.Thread(target=read, args=(i, a, b), name=f"mixdesk-read-{i}", daemon=True)
        for i, (a, b) in enumerate(bounds)
    ]
    for w in workers:
        w.start()
    try:
        for w in workers:
            while w.is_alive():
                w.join(0.05)
                if step is not None and not stop.is_set():
                    step(sum(done) / n)
    except BaseException:
        stop.set()
        raise
    finally:
        for w in workers:
            w.join()
    if errors:
        raise errors[0]
    if step is not None:
        step(1.0)
