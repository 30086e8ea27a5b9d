"""Shared fixtures: the real SmolLM2 file, the llama.cpp reference data, and an
isolated MIXDESK_HOME so tests never touch the user's settings."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def reference_dir() -> Path:
    env = os.environ.get("MIXDESK_REFERENCE")
    return Path(env) if env else REPO.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def ref_dir() -> Path:
    d = reference_dir()
    assert d.is_dir(), f"reference data not found at {d} (set MIXDESK_REFERENCE)"
    return d


@pytest.fixture(scope="session")
def reference(ref_dir) -> dict:
    return json.loads((ref_dir / "smollm2_f32_llamacpp.json").read_text())


@pytest.fixture(scope="session")
def reference_q4(ref_dir) -> dict:
    return json.loads((ref_dir / "smollm2_q4_1_llamacpp.json").read_text())


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from core.default_model import ensure_default_model
    return ensure_default_model(log=lambda m: None)


@pytest.fixture(scope="session")
def smollm_meta(smollm_path) -> dict:
    from core.gguf_file import GGUFFile
    return GGUFFile(smollm_path).metadata


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MIXDESK_HOME", str(tmp_path_factory.mktemp("mixdesk_home")))
