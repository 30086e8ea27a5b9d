"""Where Mixdesk keeps its files (platformdirs). ``MIXDESK_HOME`` overrides all of
them at once, which tests use to isolate settings from the user's real ones."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "mixdesk"


def _override(sub: str) -> Path | None:
    root = os.environ.get("MIXDESK_HOME")
    return Path(root) / sub if root else None


def cache_dir() -> Path:
    # The model cache is shared even when MIXDESK_HOME isolates settings, so a
    # test run does not re-download or re-dequantize the default model.
    root = os.environ.get("MIXDESK_CACHE")
    p = Path(root) if root else Path(platformdirs.user_cache_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


def config_dir() -> Path:
    p = _override("config") or Path(platformdirs.user_config_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p


def data_dir() -> Path:
    p = _override("data") or Path(platformdirs.user_data_dir(APP))
    p.mkdir(parents=True, exist_ok=True)
    return p
