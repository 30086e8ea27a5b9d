"""Shared fixtures: the real SmolLM2 file, the llama.cpp reference data, and an
isolated MIXDESK_HOME so tests never touch the user's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reference import reference_dir


@pytest.fixture(scope="session")
def ref_dir() -> Path:
    return reference_dir()


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
