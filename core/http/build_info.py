"""llama-server's build string, ``b<build number>-<commit>``, for Mixdesk.

llama.cpp's build number is its commit count; ours is too, with the short commit
hash, so ``/props`` ``build_info`` and every ``system_fingerprint`` look like
llama-server's (``b188-60b384c``). Computed once per process (git is asked once,
at startup); outside a git checkout (an installed wheel, no git) it is
``b0-unknown``, as llama.cpp's own fallback.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNKNOWN = "b0-unknown"


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=5,
        check=True,
    )
    return out.stdout.strip()


@functools.lru_cache(maxsize=1)
def build_info() -> str:
    if not (REPO / ".git").exists():  # an installed copy: never ask an enclosing repo
        return UNKNOWN
    try:
        number = int(_git("rev-list", "--count", "HEAD"))
        commit = _git("rev-parse", "--short=7", "HEAD")
    except (OSError, subprocess.SubprocessError, ValueError):
        return UNKNOWN
    if not commit:
        return UNKNOWN
    return f"b{number}-{commit}"
