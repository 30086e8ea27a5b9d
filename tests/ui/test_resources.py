"""Resources load through importlib.resources, so that `pipx install .` finds them
(tests/test_packaging.py installs a built wheel and checks it from outside)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import ui.util as util


def test_resources_come_from_the_resources_package():
    assert util.RESOURCES == Path(str(importlib.resources.files("resources")))
    assert (util.RESOURCES / "styles" / "mixdesk.qss").is_file()
    assert sorted(p.name for p in (util.RESOURCES / "adapters").glob("*.gguf"))


def test_a_bundle_without_the_package_falls_back_to_the_folder_next_to_ui(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", missing)
    assert util.resources_dir() == Path(util.__file__).resolve().parents[1] / "resources"
