"""Where llama.cpp's reference data (../shared/reference) is, for tests and fixtures."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reference_dir() -> Path:
    """$MIXDESK_REFERENCE, else ../shared/reference beside this checkout, else beside
    the checkout this one was cloned from (a clone made elsewhere, e.g. in /tmp)."""
    env = os.environ.get("MIXDESK_REFERENCE")
    if env:
        return Path(env)
    here = REPO.parent / "shared" / "reference"
    origin = _origin_checkout()
    if not here.is_dir() and origin is not None and (origin.parent / "shared" / "reference").is_dir():
        return origin.parent / "shared" / "reference"
    return here


def _origin_checkout() -> Path | None:
    """The local checkout ``git clone`` copied this one from, if it was local."""
    try:
        url = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    return path.resolve() if url and path.is_dir() else None
