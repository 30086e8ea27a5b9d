"""Where llama.cpp's reference data lives: ``tests/data/llamacpp`` in this repository.

One resolver for the tests, ``bench/`` and ``tools/``; the data ships with the code,
so a fresh clone anywhere has it (see tests/data/llamacpp/README.md for its origin).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO / "tests" / "data" / "llamacpp"


def reference_dir() -> Path:
    """The folder holding the llama-server JSON records and the reference adapters."""
    return REFERENCE_DIR
