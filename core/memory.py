"""Anonymous memory from the OS, page by page: the one way Mixdesk asks for a large
buffer whose pages it wants to control (a KV pool's, a model file's bytes read in).

numpy's allocator gives large arrays transparent huge pages on Linux; the two users
here want a choice: the KV pool 4 KB pages (2 MB pages would make a whole pool
resident at once, each (layer, slot, head) run of positions starting on one), the
model's bytes 2 MB pages (the kernels stream them faster: core/gguf/reader.py)."""

from __future__ import annotations

import mmap
import platform
import sys

# Python's mmap module names MAP_NORESERVE only from 3.13; on 3.11 take Linux's value
# (0x4000 on x86-64 and arm64). Elsewhere the flag is left out.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0) or (
    0x4000
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
    else 0
)


def anonymous(n_bytes: int, huge_pages: bool, reserve: bool = True) -> mmap.mmap:
    """``n_bytes`` of private anonymous memory, zeros until written, committed page by
    page on first touch; advised for transparent huge pages (``huge_pages``) or
    against them, where the OS takes the advice. ``reserve=False``: address space
    only, no commit charge (MAP_NORESERVE), so the kernel's overcommit heuristic does
    not refuse a buffer that will mostly stay untouched. Private: a shared anonymous
    map (Python's default on POSIX) is shmem, where huge pages are usually off.
    OSError (ENOMEM) when the address space is not there."""
    n = max(n_bytes, 1)
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if reserve else _MAP_NORESERVE)
        buf = mmap.mmap(-1, n, flags=flags)
    else:  # Windows: a page-file backed, zeroed section
        buf = mmap.mmap(-1, n)
    advice = "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE"
    if hasattr(buf, "madvise") and hasattr(mmap, advice):
        try:
            buf.madvise(getattr(mmap, advice))
        except OSError:
            pass  # a kernel without transparent huge pages: 4 KB pages either way
    return buf
