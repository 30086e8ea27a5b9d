"""Mixdesk's version: one string, ``[project] version`` in pyproject.toml.

Read at run time, never copied into the code: from the pyproject.toml next to the
code when there is one (a checkout, or the PyInstaller bundle, which ships it), else
from the installed distribution's metadata (``pipx install .``). ``mixdesk --version``,
the window's About box, ``/props`` ``mixdesk_version`` and every exported file's
metadata show it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
DIST = "mixdesk"
UNKNOWN = "0+unknown"


def _from_pyproject(path: Path) -> str | None:
    """The version of a pyproject.toml that is Mixdesk's own (another project's file
    next to an installed copy is not ours)."""
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != DIST or not isinstance(project.get("version"), str):
        return None
    return project["version"]


@functools.lru_cache(maxsize=1)
def version() -> str:
    """The version of the code that is running, e.g. "0.2.0"."""
    # the checkout's own file first: an older `pip install .` in the same venv would
    # otherwise name a version that is not the code being run
    found = _from_pyproject(PYPROJECT) if PYPROJECT.is_file() else None
    if found:
        return found
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN
