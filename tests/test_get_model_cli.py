"""main.py --get-model: the catalogue from the command line (the models the suite uses
are already in the cache, so nothing is downloaded here)."""

from __future__ import annotations

import subprocess
import sys

from core import catalog

REPO_MAIN = [sys.executable, "main.py"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REPO_MAIN, *args], capture_output=True, text=True, timeout=300)


def test_get_model_prints_the_cached_path(smollm_path):
    r = run("--get-model", "smollm2-135m")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(smollm_path.name)
    assert "SmolLM2" in r.stderr  # the summary line


def test_get_model_list_names_every_model():
    r = run("--get-model", "list")
    assert r.returncode == 0, r.stderr
    for name in catalog.names():
        assert r.stdout.count(f"{name}:") == 1


def test_an_unknown_name_is_one_line_naming_the_choices():
    r = run("--get-model", "llama-70b")
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "smollm2-135m" in lines[0], r.stderr
