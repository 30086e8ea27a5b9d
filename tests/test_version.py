"""One version string, pyproject.toml's, shown everywhere: `mixdesk --version`, the
window's About box (tests/ui/test_about.py), /props and exported files (test_export.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from test_http_api import req

from core import version as V
from tests.serving import running_engine, serving

REPO = Path(__file__).resolve().parents[1]


def pyproject_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_version_is_pyprojects():
    assert V.version() == pyproject_version()
    assert V.version().count(".") == 2  # major.minor.patch


def test_main_py_version_prints_it_and_exits_0():
    out = subprocess.run(
        [sys.executable, "main.py", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"mixdesk {pyproject_version()}"


def test_an_installed_copy_reads_the_distributions_metadata(tmp_path, monkeypatch):
    """Installed (no pyproject.toml next to core/): the version comes from the
    installed distribution's metadata, here a real dist-info on sys.path."""
    dist = tmp_path / "mixdesk-9.8.7.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mixdesk\nVersion: 9.8.7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(V, "PYPROJECT", tmp_path / "no" / "pyproject.toml")
    V.version.cache_clear()
    try:
        assert V.version() == "9.8.7"
    finally:
        V.version.cache_clear()


def test_another_projects_pyproject_is_not_read(tmp_path, monkeypatch):
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "5.0.0"\n')
    assert V._from_pyproject(other) is None
    other.write_text("not toml [")
    assert V._from_pyproject(other) is None
    monkeypatch.setattr(V, "PYPROJECT", other)
    V.version.cache_clear()
    try:
        assert V.version() != "5.0.0"  # the installed metadata, or 0+unknown
    finally:
        V.version.cache_clear()


def test_props_names_the_version_and_keeps_llama_servers_fields(smollm_path):
    with running_engine(smollm_path, ctx_size=128, n_parallel=1) as eng, serving(eng) as srv:
        status, body = req(srv, "GET", "/props")
    assert status == 200
    assert body["mixdesk_version"] == pyproject_version()
    assert body["build_info"].startswith("b")  # llama-server's field, unchanged
    assert {"default_generation_settings", "total_slots", "model_path"} <= set(body)
