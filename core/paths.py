"""Where Mixdesk keeps its files (platformdirs). ``MIXDESK_HOME`` overrides all of
them at once, which tests use to isolate settings from the user's real ones."""

from __future__ import annotations

import importlib.resources
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


def resources_dir() -> Path:
    """The ``resources`` package's folder (icons, the web page, demo adapters), through
    importlib.resources: the checkout's resources/ when run from it,
    site-packages/resources after ``pipx install .``. Qt and numpy need real files,
    and wheels install unzipped, so it is a Path. A PyInstaller bundle copies
    resources/ next to core/ as data (not as a package): that is the fallback."""
    try:
        root = importlib.resources.files("resources")
    except ModuleNotFoundError:
        root = None
    if isinstance(root, Path) and root.is_dir():
        return root
    return Path(__file__).resolve().parents[1] / "resources"
