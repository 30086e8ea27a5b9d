"""What every compiled kernel shares: numba configured before it is imported (the
cache dir, the vector width), the block types' codes and sizes, the ``_jit`` decorator
with the on-disk cache, and the small readers of block fields (float16 scales, Q5 high
bits, K-quant scales) that the dequantizers (core/model/kernels.py) and the fused dots
(core/model/kernel_dots.py, core/model/kernel_wide.py) call."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..paths import cache_dir

KERNEL_SOURCES = (
    "kernel_base.py",
    "kernel_dots.py",
    "kernel_wide.py",
    "kernels.py",
    "kernel_q8.py",
    "kernel_attn.py",
)


def sources_digest() -> str:
    """A short digest of the kernels' source files. numba checks a cached kernel only
    against the file of the function compiled (kernels.py's entry points), not the
    modules it calls: after an update that changed only kernel_dots.py, the old dots
    would run from the cache. So the cache lives in a folder named by this digest."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in KERNEL_SOURCES:
        try:
            h.update((here / name).read_bytes())
        except OSError:  # a frozen app without sources: numba cannot cache there anyway
            h.update(name.encode())
    return "kernels-" + h.hexdigest()[:12]


# a kernel cache folder of another version of the kernels that no process has used for
# this long is deleted (a few MB each; every update of the kernels makes a new one)
STALE_CACHE_DAYS = 14


def prune_caches(
    root: Path, keep: str, now: float | None = None, legacy: bool = False
) -> list[Path]:
    """Mark ``root/keep`` used now and delete the other kernel cache folders of ``root``
    (``kernels-*``, what :func:`sources_digest` names) unused for STALE_CACHE_DAYS:
    an update leaves its predecessor's folder behind, and a checkout and an installed
    copy that take turns keep theirs. ``legacy`` (``root`` is Mixdesk's own folder, not
    one the user named): any other folder in it too, numba's per-module folders that
    versions before the digest layout wrote straight into ``root``. Returns the folders
    deleted. Never raises: a cache that cannot be tidied costs disk space, not a load."""
    now = time.time() if now is None else now
    gone = []
    try:
        mine = root / keep
        mine.mkdir(parents=True, exist_ok=True)
        os.utime(mine, (now, now))  # loading from the cache writes nothing: say "used"
        for d in root.glob("*" if legacy else "kernels-*"):
            if d.name != keep and d.is_dir() and now - d.stat().st_mtime > STALE_CACHE_DAYS * 86400:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
    except OSError:
        pass
    return gone


def _configure() -> None:
    """Set what numba reads when it is imported (a variable the user set wins):

    * NUMBA_CACHE_DIR: compiled kernels go to the user cache dir (or the folder the
      user set), in a subfolder named by :func:`sources_digest`; other versions'
      subfolders unused for STALE_CACHE_DAYS are deleted (:func:`prune_caches`);
    * NUMBA_CPU_FEATURES: on a CPU with AVX-512, the host's features without LLVM's
      preference for 256-bit vectors. LLVM keeps to 256 bits on such CPUs (early
      ones slowed their clock for 512-bit work); the fused dots then ran at
      7.5-9.6 G weights/s against 6.8-8.3 (Q4_K) and the dequantize-then-dot kernels
      1.2-1.3x faster (one thread, Emerald Rapids, 2026-12-06). numba keys its disk
      cache on the features, so a cached kernel never runs on a CPU it was not
      built for."""
    ours = not os.environ.get("NUMBA_CACHE_DIR")  # not a folder the user (or a parent) named
    root = Path(os.environ.get("NUMBA_CACHE_DIR") or cache_dir() / "numba")
    digest = sources_digest()
    # a child process inherits the folder already named
    os.environ["NUMBA_CACHE_DIR"] = str(root if root.name == digest else root / digest)
    prune_caches(root.parent if root.name == digest else root, digest, legacy=ours)
    if not os.environ.get("NUMBA_CPU_FEATURES") and not os.environ.get("NUMBA_CPU_NAME"):
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features()
        if features.get("avx512f"):
            os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"


_configure()

import numba  # noqa: E402  (after NUMBA_CACHE_DIR is set)
from llvmlite import ir  # noqa: E402
from numba import njit  # noqa: E402
from numba.core import cgutils  # noqa: E402

# numba may have been imported before us (by another library): it reads the folder
# from its config when a function is decorated, so setting it here is in time
numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
if os.environ.get("NUMBA_CPU_FEATURES") and not numba.config.CPU_FEATURES:
    numba.config.CPU_FEATURES = os.environ["NUMBA_CPU_FEATURES"]

# GGMLQuantizationType values (gguf.constants): the codes the kernels are specialised on
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

# elements per block and bytes per block (gguf.constants.GGML_QUANT_SIZES)
BLOCK = {
    F16: (1, 2),
    BF16: (1, 2),
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q3_K: (256, 110),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
}

_CACHE = True  # compiled kernels go to NUMBA_CACHE_DIR (core/model/quant.py sets it)


def _jit(entry: bool = False, **kw):
    """njit; an ``entry`` point (what Python calls: a type's rows and small products,
    quantize_x) with the on-disk cache, without a place to cache (a frozen app whose
    sources are not files) in memory instead of failing at import.

    Only entry points are cached: an entry's cached code holds the functions it calls,
    so a warm start compiles nothing either way, and each type's entry points are
    written by the one process compiling that type. A cached helper used by several
    types (``_launch``, specialised per type) was written by every process compiling
    at once (quant.warm_up's helpers): numba's index is read, extended and rewritten
    without a lock, two processes took the same data file for different types, and a
    later load ran one type's code on another's blocks: a segfault at every start
    (2026-12-06, a first compile of Q4_K and Q6_K with a helper; tests/test_quant_kernels.py
    checks that only entry points reach the cache)."""

    def deco(fn):
        if not entry:
            return njit(**kw)(fn)
        try:
            return njit(cache=_CACHE, **kw)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return njit(**kw)(fn)

    return deco


# f16 exponent e -> 2^(e-25) (the value is (1024 + mantissa) * that), and 2^-24 for
# subnormals (mantissa * 2^-24); both products are exact in float32
_F16_SCALE = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)


@_jit()
def _f16(w, o):
    """The float16 stored little-endian at w[o:o+2], as float32 (exact)."""
    h = np.int32(w[o]) | (np.int32(w[o + 1]) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    elif e == 0:
        v = np.float32(m) * _F16_SCALE[0]
    else:
        v = np.float32(m | 1024) * _F16_SCALE[e]
    return -v if h & 0x8000 else v


# every float16 bit pattern as float32 (256 KB): the dots read a block's scale with
# one load instead of _f16's branches (the Q4_K dot ran 1.1x faster)
_F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@_jit(inline="always")
def _f16t(w, o):
    """_f16 through _F16_TABLE (the same value)."""
    return _F16_TABLE[np.int32(w[o]) | (np.int32(w[o + 1]) << 8)]


@_jit(inline="always")
def _size32(code):
    """Bytes per block of the 32-element types Q4_0, Q4_1, Q5_0, Q5_1 and of Q8_0
    (BLOCK's, for the jitted code: a constant once ``code`` is)."""
    if code == Q8_0:
        return 34
    return 18 if code == Q4_0 else 20 if code == Q4_1 else 22 if code == Q5_0 else 24


@_jit(inline="always")
def _size256(code):
    """Bytes per block of the K-quants with 512-bit code, Q4_K, Q5_K, Q6_K (BLOCK's)."""
    return 144 if code == Q4_K else 176 if code == Q5_K else 210


@_jit()
def _qh32(w, o):
    """The 32 high bits of a Q5 block (little-endian uint32 at w[o:o+4])."""
    return (
        np.uint32(w[o])
        | (np.uint32(w[o + 1]) << 8)
        | (np.uint32(w[o + 2]) << 16)
        | (np.uint32(w[o + 3]) << 24)
    )


@_jit()
def _k_scale_min(w, o, j):
    """Sub-block j's 6-bit scale and min in the 12 packed bytes at w[o] (Q4_K, Q5_K)."""
    if j < 4:
        return np.uint8(w[o + j] & 63), np.uint8(w[o + j + 4] & 63)
    sc = np.uint8(w[o + j + 4] & 15) | np.uint8((w[o + j - 4] >> 6) << 4)
    m = np.uint8(w[o + j + 4] >> 4) | np.uint8((w[o + j] >> 6) << 4)
    return sc, m


def target_has(feature: str) -> bool:
    """Whether the CPU numba compiles for has ``feature`` (an LLVM name: "avx512f"):
    the features the user (or _configure) gave numba, else none for a CPU the user
    named (NUMBA_CPU_NAME: a portable build), else the host's. A kernel written for an
    instruction set is compiled only where this says so: LLVM cannot lower it elsewhere."""
    import llvmlite.binding as llvm

    chosen = numba.config.CPU_FEATURES
    if chosen:
        return f"+{feature}" in chosen.split(",")
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        return False
    return bool(llvm.get_host_cpu_features().get(feature))


# ---- LLVM IR for the kernels numba's loops cannot express (kernel_dots, kernel_q8) ----

# A decode step streams the weights faster than the hardware prefetcher brings them
# from RAM: every product of a 1B-shaped Q4_K_M token, each matrix read once, took
# 81 ms on the 8-bit-activation kernels without a software prefetch, 67 ms with one
# 2 KB ahead, 58 ms at 4 KB and 56-58 ms at 8 KB (2 threads, 2026-12-06)
PREFETCH = 4096


def ir_fn(builder, name: str, ret, args):
    """The LLVM function (an intrinsic) ``name`` of type ret(args), declared once."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def ir_at(context, builder, aty, arr, off, vty):
    """A pointer to ``vty`` at element ``off`` of the 1-D array ``arr`` of type aty."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [off]), vty.as_pointer())


def ir_literal(ty) -> int:
    """The value of an intrinsic's constant argument (numba's literal type), or ask
    numba to compile the call again with the argument as a literal."""
    from numba.core import errors

    if not isinstance(ty, (numba.types.IntegerLiteral, numba.types.BooleanLiteral)):
        raise errors.RequireLiteralValue(ty)
    return int(ty.literal_value)


def ir_prefetch(builder, ptr, ahead: int = PREFETCH) -> None:
    """Ask for the cache line ``ahead`` bytes past ``ptr`` to be read soon (a hint: it
    never faults, past the end of an array too)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = ir_fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, i32, i32, i32])
    p = builder.gep(builder.bitcast(ptr, i8p), [ir.Constant(i32, ahead)])
    # read (0), keep in every cache level (3), data (1)
    builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
