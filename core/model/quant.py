"""Weight matrices kept in their GGUF block formats, multiplied in place (issue 35).

``QuantMatrix`` wraps a (out, row_bytes) uint8 array, usually a view of the GGUF's
bytes (read into memory, or its memory map: core/model/weights.py), and offers what
the model needs of a weight matrix:

* ``matmul(x)``: ``x @ W.T`` for float32 activations (T, in) -> (T, out). Up to
  SMALL rows (decode, a batch of mixes) run on the compiled small-batch kernels
  (core/model/kernels.py), which read each weight block once for all T rows; more
  rows (prefill) dequantize tiles of TILE_FLOATS weights into a scratch buffer and
  hand each tile to BLAS, so prefill runs near float32 gemm speed.
* ``dequantize(a, b)``: rows [a, b) as float32, the same bits as ``gguf.quants``;
* ``take(ids)``: selected rows as float32 (the embedding lookup);
* ``rows(a, b)``: a view of rows [a, b), still quantized.

``FusedMatrix`` stacks several of them (and float32 arrays) by rows, as the model
fuses Q|K|V and gate|up; its parts may be of different types (a Q4_K_M file has
Q4_K and Q6_K matrices side by side).

The kernels index raw memory, so every matrix is checked first (``check_layout``):
rows of whole blocks, and exactly the bytes its shape and type need. A truncated
or corrupt file is then a ``QuantLayoutError``, never a read past the buffer.

Threads: the kernels run on numba's threads, ``set_threads(n)`` of them (the
model's -t). Calls from several Python threads are serialised by one lock: the
kernels use every core anyway, and numba's fallback thread pool ("workqueue")
must never be entered twice at once (it aborts the process).

Kernels run from one long-lived thread, the engine's. numba's OpenMP layer (GNU
libgomp) keeps a team of worker threads for every thread that ever launched a
parallel kernel, until that thread ends; with more such workers than CPUs, libgomp
cuts the time an idle worker spins before it sleeps to a hundred turns, and each of a
token's ~210 launches (SmolLM2) then waits for a worker to wake. A load on the main
thread left its team behind, and SmolLM2 decoded on the engine thread at 10.2-10.8
ms a token instead of 8.0-8.4 (2 cores, 2026-12-06). So the load's kernel work
(``warm_up``) runs on a thread of its own that ends with it (``on_passing_thread``).
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..gguf.reader import GGUFError
from ..options import ACTIVATION_MODES
from .kv_cache import KV_DTYPES, kernel_view

T = GGMLQuantizationType
R = TypeVar("R")
log = logging.getLogger(__name__)

# types served by the compiled kernels (F32 by numpy); any other (IQ*, TQ*, MXFP4)
# takes the model's float32 path
SUPPORTED = frozenset(
    {
        T.F32,
        T.F16,
        T.BF16,
        T.Q8_0,
        T.Q4_0,
        T.Q4_1,
        T.Q5_0,
        T.Q5_1,
        T.Q2_K,
        T.Q3_K,
        T.Q4_K,
        T.Q5_K,
        T.Q6_K,
    }
)

SMALL = 16  # up to this many activation rows run on the small-batch kernels
# The small-batch kernels run in K-chunks: elements of x per K-chunk and activation row
# such that T rows x K floats of x (32 KB) stay in L1 while a chunk of output rows
# passes over them; and a chunk no longer than X_CHUNK_MAX, whatever T: with 2-3 rows
# the chunk of x alone fitted in L1 but not beside the dequantized chunk of W: 2048
# made the 8192-wide down matrices' products 9-13% faster than 4096 for T=2 and 7-11%
# than 2560 for T=3 (Q4_K and Q6_K, 2 threads, interleaved best of 6-12), and 2048 was
# within 4% of the best of 1024, 2048 and 4096 for every T of 2-4 on every 1B shape
# (2026-12-06).
X_CHUNK_FLOATS = 8192
X_CHUNK_MAX = 2048
# prefill: weights dequantized per tile, 16 MB of float32 (2048 rows of a 2048-wide
# matrix). Larger tiles mean fewer, larger BLAS calls, and each call pays for waking
# OpenBLAS's threads: 512 rows x Q4_K 8192x2048 with 2 threads took 1.5-1.6 s in
# 512-row tiles, 0.43-0.54 s in 2048-row tiles, 0.28-0.38 s as numpy's one gemm on
# the dequantized matrix (busy 2-core VM, /tmp bench of the same run). The tile is
# written and read once per product, so it need not fit a cache: BLAS packs it anyway.
TILE_FLOATS = 4 << 20

_lock = threading.Lock()  # one kernel launch at a time (see the module docstring)
_threads = 0  # numba threads per kernel; 0 until set_threads (numba's default)
_local = threading.local()  # per-thread prefill scratch


class QuantLayoutError(GGUFError):
    """A quantized tensor's bytes do not match its shape and type."""


_KERNELS = None  # the kernels module, once imported
_LATER: dict = {}  # the other kernel modules, once imported (_later)


def _kernels():
    """core/model/kernels.py, imported on first use: importing numba costs ~0.3 s, and
    a model on the float32 path never needs it. Kept in a global: a function-level
    import on every product cost SmolLM2's decode ~0.8 ms a token (210 products)."""
    global _KERNELS
    if _KERNELS is None:
        from . import kernels

        _KERNELS = kernels
    return _KERNELS


def _later(name: str):
    """core/model/<name>.py, a kernel module imported on first use (as _kernels) with
    numba configured first: kernel_q8 (the 8-bit-activation products), kernel_attn
    (decoding attention)."""
    mod = _LATER.get(name)
    if mod is None:
        _kernels()
        mod = _LATER[name] = importlib.import_module(f".{name}", __package__)
    return mod


def import_kernels() -> None:
    """Import numba and the kernel modules every load runs (the matrix kernels and the
    decoding attention): ~0.5 s, most of what the compiled kernels add to a warm start.
    A loader calls it on a thread of its own while the model's weights are read, which
    release Python's lock; warm_up then only loads (or compiles) the kernels. It
    compiles one tiny helper and launches nothing, so it leaves no thread pool behind
    (on_passing_thread)."""
    _later("kernel_attn")


def _q8():
    """core/model/kernel_q8.py, imported on first use."""
    return _later("kernel_q8")


def attention_kernel(kv_types: tuple[str, str] = ("f32", "f32")):
    """The compiled decoding attention (core/model/kernel_attn.py) over keys and values
    stored as ``kv_types`` (-ctk/-ctv), for core/model/attention.py's decode_attention
    to launch."""
    return _later("kernel_attn").ENTRIES[kv_types]


def launch(kernel, *args, threads: int = 0):
    """``kernel(*args)`` launched as every compiled kernel is: one launch at a time (see
    the module docstring), on ``threads`` threads (0: set_threads's)."""
    with _lock:
        _use_threads(threads)
        return kernel(*args)


def kernel_threads() -> int:
    """The threads a kernel runs on (set_threads's count; 1 before it)."""
    return max(1, _threads)


def q8_available() -> bool:
    """Whether this CPU runs the 8-bit-activation kernels (it needs VNNI)."""
    return _q8().available()


def activations_in_force(mode: str) -> str:
    """The activations a matrix asked for ``mode`` ("f32" or "q8") is multiplied by:
    "q8" needs a CPU with VNNI (q8_available); without one, "f32" (the caller says so)."""
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, not {mode!r}")
    return "q8" if mode == "q8" and q8_available() else "f32"


def set_threads(n: int) -> None:
    """Run the kernels on ``n`` threads (at most numba's pool size, NUMBA_NUM_THREADS)."""
    global _threads
    numba = _kernels().numba  # kernels.py configures numba before importing it

    _threads = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))


def _use_threads(n: int = 0) -> None:
    """Run the next kernel on ``n`` threads (0: set_threads's count). numba's thread
    count is per calling thread: it is set in whichever thread calls, and remembered
    here per thread (numba.get_num_threads on every product cost ~0.9 ms a token)."""
    n = n or _threads
    if n and getattr(_local, "threads", 0) != n:
        _kernels().numba.set_num_threads(n)
        _local.threads = n
        if n > 1:
            _note_launcher()


# threads whose kernels ran on several threads, so that may keep an OpenMP team
_launchers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _note_launcher() -> None:
    """Warn when this thread starts multi-threaded kernels while another live thread
    has: numba's OpenMP layer then keeps two teams of workers, more than the cores,
    and every product waits for a worker to wake (see the module docstring). Kernel
    work off the engine thread belongs in ``on_passing_thread`` or on the engine
    thread (``Engine.run_on_engine``)."""
    if getattr(_local, "passing", False):
        return
    me = threading.current_thread()
    if me in _launchers:  # noted (and warned of) at its first launch on several threads
        return
    # named with their idents: two engines' threads share the name "mixdesk-engine"
    others = [f"{t.name}#{t.ident}" for t in list(_launchers) if t is not me and t.is_alive()]
    _launchers.add(me)
    if others:
        log.warning(
            "compiled kernels started on thread %r while thread %r keeps its own team of "
            "kernel threads: every product now waits for a worker to wake (SmolLM2 "
            "decoded ~25%% slower so); run kernel work off the engine thread on "
            "quant.on_passing_thread",
            f"{me.name}#{me.ident}",
            others[0],
        )


def qtype_of(qtype: int | str | GGMLQuantizationType) -> GGMLQuantizationType:
    """A GGMLQuantizationType from itself, its value or its name ('Q4_K')."""
    if isinstance(qtype, str):
        return T[qtype.upper()]
    return T(qtype)


def check_layout(
    qtype: GGMLQuantizationType, shape: Sequence[int], nbytes: int, name: str = "tensor"
) -> int:
    """Check that a (out, in) matrix of ``qtype`` is exactly ``nbytes`` of whole
    blocks, before anything indexes its memory; return the bytes per row.
    Raises QuantLayoutError naming the tensor and what is wrong."""
    qtype = qtype_of(qtype)
    if len(shape) != 2 or any(int(d) <= 0 for d in shape):
        raise QuantLayoutError(f"{name}: expected a matrix (rows, columns), not shape {shape}")
    out, n_in = (int(d) for d in shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if n_in % block:
        raise QuantLayoutError(
            f"{name}: a row of {n_in} values is not a whole number of "
            f"{qtype.name} blocks of {block}"
        )
    row_bytes = n_in // block * type_size
    if nbytes != out * row_bytes:
        raise QuantLayoutError(
            f"{name}: {qtype.name} {out}x{n_in} needs {out * row_bytes} bytes, the data "
            f"has {nbytes} (the file is truncated or corrupt)"
        )
    return row_bytes


class QuantMatrix:
    """A (out, in) weight matrix in GGUF block format; see the module docstring."""

    def __init__(
        self,
        qtype: int | str | GGMLQuantizationType,
        data: np.ndarray,
        shape: Sequence[int],
        name: str = "tensor",
        activations: str = "f32",
    ):
        """``activations``: what decode-sized products multiply by, "f32" or "q8" (a
        mode activations_in_force gave: "q8" runs only on a CPU with VNNI)."""
        self.qtype = qtype_of(qtype)
        if self.qtype not in SUPPORTED:
            raise QuantLayoutError(f"{name}: {self.qtype.name} has no compiled kernels")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise QuantLayoutError(f"{name}: the data must be a uint8 array")
        self.shape = (int(shape[0]), int(shape[1])) if len(shape) == 2 else tuple(shape)
        row_bytes = check_layout(self.qtype, self.shape, data.nbytes, name)
        self.name = name
        # (out, row_bytes) C-contiguous and read-only: the one array type the kernels
        # are compiled for (a writable array would be a second compile)
        data = np.ascontiguousarray(data).reshape(self.shape[0], row_bytes)  # (out, row_bytes)
        if data.flags.writeable:
            data = data.view()
            data.flags.writeable = False
        self.data = data
        self.activations = activations
        # this matrix's small products round x to int8 (a type with a q8 product)
        self._q8 = activations == "q8" and int(self.qtype) in _q8().PRODUCTS

    # -- numpy-like attributes --
    @property
    def dtype(self) -> str:
        """The block type's name ('Q4_K'): values come out as float32."""
        return self.qtype.name

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QuantMatrix({self.qtype.name}, {self.shape[0]}x{self.shape[1]}, {self.name})"

    # -- rows --
    def rows(self, a: int, b: int) -> QuantMatrix:
        """Rows [a, b) as a QuantMatrix sharing this one's memory."""
        a, b = _check_range(a, b, self.shape[0], self.name)
        m = object.__new__(QuantMatrix)
        m.qtype, m.name = self.qtype, self.name
        m.shape = (b - a, self.shape[1])
        m.data = self.data[a:b]
        m.activations, m._q8 = self.activations, self._q8
        return m

    def joined(self, other: QuantMatrix) -> QuantMatrix | None:
        """This matrix's rows and then ``other``'s as one matrix, without a copy, when
        ``other``'s bytes start where this one's end in the same buffer (the same type,
        width and activations); else None. A file's gate and up matrices often lie so:
        one kernel launch then serves both (FusedMatrix)."""
        a, b = self.data, other.data
        if (
            other.qtype != self.qtype
            or other.shape[1] != self.shape[1]
            or other.activations != self.activations
            or _root(a) is not _root(b)
            or a.ctypes.data + a.nbytes != b.ctypes.data
        ):
            return None
        m = object.__new__(QuantMatrix)
        m.qtype, m.name = self.qtype, f"{self.name}+{other.name.rpartition(': ')[2]}"
        m.shape = (self.shape[0] + other.shape[0], self.shape[1])
        # both lie in one buffer, back to back: a view of a's rows extended over b's
        m.data = np.lib.stride_tricks.as_strided(
            a, shape=(m.shape[0], a.shape[1]), strides=a.strides, writeable=False
        )  # (out, row_bytes)
        m.activations, m._q8 = self.activations, self._q8
        return m

    def dequantize(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows [a, b) as float32 (b - a, in), bit for bit what gguf.quants gives."""
        a, b = _check_range(a, self.shape[0] if b is None else b, self.shape[0], self.name)
        out = np.empty((b - a, self.shape[1]), dtype=np.float32)  # (b-a, in)
        self._dequantize_into(a, b, out)
        return out

    def take(self, ids) -> np.ndarray:
        """Rows ``ids`` as float32 (len(ids), in): an embedding lookup."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # (n,)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            bad = ids[(ids < 0) | (ids >= self.shape[0])][0]
            raise IndexError(f"{self.name}: row {bad} out of range for {self.shape[0]} rows")
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)  # (n, in)
        if self.qtype == T.F32:
            out[:] = self.data.view(np.float32)[ids]
        elif ids.size:
            launch(_kernels().KERNELS[int(self.qtype)][0], self.data, ids, out)
        return out

    def _dequantize_into(self, a: int, b: int, out: np.ndarray, threads: int = 0) -> None:
        if self.qtype == T.F32:
            out[:] = self.data[a:b].view(np.float32)
        elif b > a:
            rows = np.arange(a, b, dtype=np.int64)  # (b-a,)
            launch(_kernels().KERNELS[int(self.qtype)][0], self.data, rows, out, threads=threads)

    # -- products --
    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T``: x (T, in) float32 -> (T, out) float32 (x (in,) -> (out,)).
        ``out``: a (T, out) float32 array to write into (it may be a column slice)."""
        vec = x.ndim == 1
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # (T, in)
        if x.shape[1] != self.shape[1]:
            raise ValueError(f"{self.name}: x has {x.shape[1]} columns, W has {self.shape[1]}")
        n_t, n_out = x.shape[0], self.shape[0]
        if out is None:
            y = np.empty((n_t, n_out), dtype=np.float32)  # (T, out)
        else:
            if out.shape != (n_t, n_out) or out.dtype != np.float32:
                raise ValueError(f"{self.name}: out must be float32 {(n_t, n_out)}")
            y = out
        if n_t == 0:
            pass
        elif self.qtype == T.F32:
            np.matmul(x, self.data.view(np.float32).T, out=y)  # (T, out)
        elif n_t <= SMALL:
            if self._q8:
                self._small_q8(x, y)
            else:
                self._small(x, y)
        else:
            self._prefill(x, y)
        return y[0] if vec else y

    def _small(self, x: np.ndarray, y: np.ndarray) -> None:
        k = _kernels()
        kc = max(256, min(X_CHUNK_MAX, X_CHUNK_FLOATS // x.shape[0]) // 256 * 256)  # K-chunk
        dst = y if y.flags.c_contiguous else np.empty(y.shape, dtype=np.float32)  # (T, out)
        launch(k.KERNELS[int(self.qtype)][1], self.data, x, dst, kc)
        if dst is not y:
            y[:] = dst

    def _small_q8(self, x: np.ndarray, y: np.ndarray) -> None:
        """The small-batch product with x rounded to int8 (--activations q8), one scale
        per kernel_q8.RUN[type] values."""
        k = _q8()
        n_t, n_in = x.shape
        x8 = np.empty((n_t, n_in), dtype=np.int8)  # (T, in)
        run = k.RUN[int(self.qtype)]  # activations per scale: 256 (K-quants) or 32
        xd = np.empty((n_t, n_in // run), dtype=np.float32)  # (T, in/run) scales
        xs = np.empty((n_t, n_in // 32), dtype=np.float32)  # (T, in/32) sums, scaled
        dst = y if y.flags.c_contiguous else np.empty(y.shape, dtype=np.float32)  # (T, out)
        launch(k.quantize_x, x, x8, xd, xs)
        launch(k.PRODUCTS[int(self.qtype)], self.data, x8, xd, xs, dst)
        if dst is not y:
            y[:] = dst

    def _prefill(self, x: np.ndarray, y: np.ndarray) -> None:
        _tiled_product(self, x, y)


def _tiled_product(m: QuantMatrix | FusedMatrix, x: np.ndarray, y: np.ndarray) -> None:
    """y = x @ W.T for a prefill: tiles of W's rows dequantized into a reused scratch,
    each multiplied by BLAS.

    The tiles are dequantized on this thread alone: it costs a few percent of the
    gemm, and waking numba's threads between BLAS calls made both pools fight for
    the cores (OpenBLAS's threads spin after a call): 512 rows of a Q4_K 8192x2048
    matrix took 1.6-1.9 s against numpy's 0.35-0.45 s on the busy 2-core VM, with
    numba on two threads. The tiles are of equal size: a ragged last tile is a thin
    gemm, which BLAS runs far below its speed (Qwen2.5-0.5B's 896x4864 down matrix
    had 862 rows and then 34). A fused matrix's parts share the tiles, one gemm a
    tile, as the float32 path's one concatenated array does."""
    n_out, n_in = m.shape
    tile = max(16, TILE_FLOATS // n_in)  # rows per tile at most
    n_tiles = -(-n_out // tile)
    tile = -(-n_out // n_tiles)
    scratch = _scratch(min(tile, n_out) * n_in)
    for a in range(0, n_out, tile):
        b = min(n_out, a + tile)
        w = scratch[: (b - a) * n_in].reshape(b - a, n_in)  # (tile, in)
        m._dequantize_into(a, b, w, threads=1)
        np.matmul(x, w.T, out=y[:, a:b])  # (T, tile)


def _scratch(n: int) -> np.ndarray:
    """A float32 buffer of at least ``n`` for this thread, kept between calls: a fresh
    16 MB array would be page-faulted in anew by every prefill product."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.float32)
    return buf


def _root(a: np.ndarray) -> object:
    """The object whose memory an array views at the end of its chain of bases (the
    file's mapping behind GGUFFile.raw's memoryviews), or the array itself when it owns
    its memory."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    base = a if a.base is None else a.base
    return base.obj if isinstance(base, memoryview) else base


def _check_range(a: int, b: int, n: int, name: str) -> tuple[int, int]:
    a, b = int(a), int(b)
    if not 0 <= a <= b <= n:
        raise IndexError(f"{name}: rows [{a}, {b}) out of range for {n} rows")
    return a, b


class FusedMatrix:
    """Matrices stacked by rows (Q|K|V, gate|up), each QuantMatrix or float32 array,
    all with the same number of columns; the API of QuantMatrix."""

    def __init__(self, parts: Iterable[QuantMatrix | np.ndarray], name: str = "fused"):
        self.parts = list(parts)
        if not self.parts:
            raise ValueError("FusedMatrix needs at least one part")
        cols = {p.shape[1] for p in self.parts}
        if len(cols) != 1 or any(len(p.shape) != 2 for p in self.parts):
            raise ValueError(f"{name}: parts must be matrices with equal columns, got {cols}")
        for p in self.parts:
            if isinstance(p, np.ndarray) and p.dtype != np.float32:
                raise ValueError(f"{name}: a float part must be float32, not {p.dtype}")
        self.name = name
        self.offsets = np.cumsum([0] + [p.shape[0] for p in self.parts]).tolist()
        self.shape = (self.offsets[-1], cols.pop())
        # the products' runs (matrix, first row, end row): parts that lie back to back
        # in one buffer joined (QuantMatrix.joined), one kernel launch for each run.
        # SmolLM2's gate|up: 82 against 86 us (576 wide, Q4_1, 2 threads, hot caches;
        # a launch costs ~5 us whatever its size)
        self._runs: list[tuple[QuantMatrix | np.ndarray, int, int]] = []
        for p, lo, hi in zip(self.parts, self.offsets, self.offsets[1:]):
            last = self._runs[-1][0] if self._runs else None
            both = isinstance(last, QuantMatrix) and isinstance(p, QuantMatrix)
            joined = last.joined(p) if both else None
            if joined is not None:
                self._runs[-1] = (joined, self._runs[-1][1], hi)
            else:
                self._runs.append((p, lo, hi))

    @property
    def dtype(self) -> str:
        """The parts' types, joined ('Q4_K+Q6_K'; F32 for a float array)."""
        names = [p.dtype if isinstance(p, QuantMatrix) else "F32" for p in self.parts]
        return "+".join(dict.fromkeys(names))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"FusedMatrix({self.dtype}, {self.shape[0]}x{self.shape[1]}, {self.name})"

    def _pieces(self, a: int, b: int):
        """(part, part's a, part's b, output offset) for rows [a, b)."""
        for p, lo, hi in zip(self.parts, self.offsets, self.offsets[1:]):
            if hi > a and lo < b:
                yield p, max(a, lo) - lo, min(b, hi) - lo, max(a, lo) - a

    def rows(self, a: int, b: int) -> QuantMatrix | FusedMatrix | np.ndarray:
        """Rows [a, b): one part's own view when they lie in one part."""
        a, b = _check_range(a, b, self.shape[0], self.name)
        pieces = [p.rows(pa, pb) if isinstance(p, QuantMatrix) else p[pa:pb]
                  for p, pa, pb, _ in self._pieces(a, b)]  # fmt: skip
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.empty((0, self.shape[1]), dtype=np.float32)
        return FusedMatrix(pieces, self.name)

    def dequantize(self, a: int = 0, b: int | None = None) -> np.ndarray:
        a, b = _check_range(a, self.shape[0] if b is None else b, self.shape[0], self.name)
        out = np.empty((b - a, self.shape[1]), dtype=np.float32)  # (b-a, in)
        self._dequantize_into(a, b, out)
        return out

    def _dequantize_into(self, a: int, b: int, out: np.ndarray, threads: int = 0) -> None:
        for p, pa, pb, o in self._pieces(a, b):
            dst = out[o : o + pb - pa]  # (pb-pa, in)
            if isinstance(p, QuantMatrix):
                p._dequantize_into(pa, pb, dst, threads)
            else:
                dst[:] = p[pa:pb]

    def take(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)  # (n,)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"{self.name}: row ids out of range for {self.shape[0]} rows")
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)  # (n, in)
        part = np.searchsorted(self.offsets, ids, side="right") - 1  # (n,) part of each id
        for k, p in enumerate(self.parts):
            sel = np.flatnonzero(part == k)
            if sel.size:
                local = ids[sel] - self.offsets[k]
                out[sel] = p.take(local) if isinstance(p, QuantMatrix) else p[local]
        return out

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T`` with each part's product written into its columns of one y."""
        vec = x.ndim == 1
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # (T, in)
        y = out if out is not None else np.empty((x.shape[0], self.shape[0]), np.float32)
        if x.shape[0] > SMALL and len(self._runs) > 1:
            # a prefill: every part in the same tiles, one gemm a tile rather than a
            # thin one a part (Q|K|V: the K and V of Qwen2.5-0.5B are 128 rows)
            _tiled_product(self, x, y)
            return y[0] if vec else y
        for p, lo, hi in self._runs:
            if isinstance(p, QuantMatrix):
                p.matmul(x, out=y[:, lo:hi])  # (T, part out)
            else:
                np.matmul(x, p.T, out=y[:, lo:hi])  # (T, part out)
        return y[0] if vec else y


def on_passing_thread(fn: Callable[[], R]) -> R:
    """``fn()`` run on a new thread that ends when it returns; its result, or its
    exception raised here. The OpenMP team of any kernel ``fn`` launches ends with that
    thread (see the module docstring), instead of staying beside the engine's."""
    box: dict = {}

    def run() -> None:
        _local.passing = True  # its team ends with it: no warning (_note_launcher)
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = e

    t = threading.Thread(target=run, name="mixdesk-kernels-passing", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def warm_up(
    qtypes: Iterable[int | str | GGMLQuantizationType],
    progress: Callable[[float], None] | None = None,
    helpers: bool = True,
    activations: str = "f32",
    kv_types: tuple[str, str] = ("f32", "f32"),
) -> float:
    """Compile the kernels of these types and the decoding attention's, or load them
    from the on-disk cache, by running each once on a tiny matrix; return the seconds
    it took. A first-ever compile takes seconds per type (a model load can show it
    as such), a cached one a few milliseconds. ``progress(fraction_done)`` after each
    type, and while waiting for a helper; it may raise to cancel.

    Types not in the cache yet are shared out, when there are several and ``helpers``:
    every other one is compiled by a second process on another core (more for more
    cores) into the same disk cache, and this process then loads it from there. numba
    compiles under Python's lock, so threads would not run side by side. A helper that
    fails costs nothing but time: this process compiles what it did not cache.
    ``activations`` ("f32", or "q8" in force): the products a model so loaded runs;
    ``kv_types``: how its KV cache stores keys and values (-ctk/-ctv), which the
    decoding attention is compiled for."""
    t0 = time.perf_counter()
    todo = sorted({qtype_of(q) for q in qtypes} & SUPPORTED - {T.F32})
    on_passing_thread(lambda: _warm(todo, progress, helpers, activations, kv_types))
    if threading_layer() == "workqueue":
        log.warning(
            "numba runs the matrix kernels on its workqueue thread pool (it found no "
            "OpenMP runtime, libgomp, nor TBB, or NUMBA_THREADING_LAYER chose it), where "
            "each product waits for its threads: small models decode ~2.5x slower "
            "(SmolLM2: 20 against 8 ms a token). Install libgomp (Debian/Ubuntu: "
            "libgomp1; Fedora: libgomp) and restart"
        )
    return time.perf_counter() - t0


def threading_layer() -> str:
    """The thread pool numba runs the kernels on ("omp", "tbb" or "workqueue"), once a
    parallel kernel has run; "" before that."""
    try:
        return _kernels().numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return ""


def _warm(
    todo: list,
    progress: Callable[[float], None] | None,
    helpers: bool,
    activations: str,
    kv_types: tuple[str, str],
):
    """warm_up's work, on the thread it makes for it."""
    cold = [qt for qt in todo if not _cached(qt, activations)]
    spawned = _compile_elsewhere(cold, activations) if helpers else {}
    try:
        for i, qt in enumerate(todo):
            proc = spawned.get(qt)
            while proc is not None and proc.poll() is None:  # its helper compiles it
                if progress is not None:
                    progress(i / len(todo))
                time.sleep(0.05)
            block, type_size = GGML_QUANT_SIZES[qt]
            n_in = 256 if block < 256 else block
            data = np.zeros(n_in // block * type_size, dtype=np.uint8)  # one row of zeros
            m = QuantMatrix(qt, data, (1, n_in), name=f"warm-up {qt.name}", activations=activations)
            m.take([0])
            m.matmul(np.zeros((2, n_in), dtype=np.float32))  # (2, 1)
            if progress is not None:
                progress((i + 1) / len(todo))
        # (slots, KV, cap, hd) keys and values as the cache stores them, in the view the
        # kernel takes (kv_cache.kernel_view)
        kc, vc = (kernel_view(np.zeros((1, 1, 2, 32), dtype=KV_DTYPES[t])) for t in kv_types)
        spans = np.array([[0, 0, 2]], dtype=np.int64)  # (n, 3)
        out = np.empty((1, 1, 2, 32), dtype=np.float32)  # (n, KV, g, hd)
        kernel = attention_kernel(kv_types)
        back = np.zeros(2, dtype=np.int64)  # (g,)
        launch(kernel, out.copy(), kc, vc, spans, back, 0.0, kernel_threads(), 1, 1, out)
    finally:
        for proc in set(spawned.values()):
            if proc.poll() is None:  # cancelled: a helper must not outlive the load
                proc.kill()
            proc.wait()


def _cached(qt: GGMLQuantizationType, activations: str = "f32") -> bool:
    """Whether the entry points this type's products use (warm_up) are in numba's disk
    cache: rows and small, or rows and the 8-bit-activation product under "q8"."""
    folder = Path(_kernels().numba.config.CACHE_DIR)
    name = qt.name.lower()
    q8 = activations == "q8" and int(qt) in _q8().PRODUCTS
    small = f"kernel_q8.q8_{name}" if q8 else f"kernels.small_{name}"
    return all(any(folder.rglob(f"{k}-*.nbi")) for k in (f"kernels.rows_{name}", small))


# A packaged app started with this in its environment compiles the kernels of the
# types it names into the disk cache and exits (main.py calls compile_for_helper):
# "ACTIVATIONS:TYPE,TYPE" ("q8:Q4_K,Q6_K"), or the types alone for "f32".
COMPILE_ENV = "MIXDESK_COMPILE_KERNELS"


def compile_for_helper(spec: str) -> None:
    """What a packaged app's compile helper does with COMPILE_ENV's value."""
    mode, _, names = spec.rpartition(":")
    warm_up(names.split(","), helpers=False, activations=mode or "f32")


def _compile_elsewhere(cold: list[GGMLQuantizationType], activations: str = "f32") -> dict:
    """Start helper processes that compile all but every (helpers + 1)-th of ``cold`` into
    the disk cache: {type: its helper's Popen}. None on one core. In the packaged app
    the executable is the app, not Python: a helper is the app started with
    COMPILE_ENV naming its types, which main.py runs before anything else."""
    n = min(len(cold) - 1, (os.cpu_count() or 1) - 1)
    if n < 1:
        return {}
    frozen = getattr(sys, "frozen", False)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding core/
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    out = {}
    for k in range(1, n + 1):
        share = cold[k :: n + 1]
        names = [qt.name for qt in share]
        if frozen:
            spec = ",".join(names) if activations == "f32" else f"q8:{','.join(names)}"
            cmd, helper_env = [sys.executable], {**env, COMPILE_ENV: spec}
        else:
            code = (
                "from core.model import quant; "
                f"quant.warm_up({names!r}, helpers=False, activations={activations!r})"
            )
            cmd, helper_env = [sys.executable, "-c", code], env
        try:
            proc = subprocess.Popen(
                cmd,
                env=helper_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:  # no process to be had: this one compiles them
            continue
        out.update(dict.fromkeys(share, proc))
    return out
