"""Slow, self-contained subprocess checks, started as soon as the session has collected
them and awaited by their tests.

A few tests compile the quant kernels from nothing in a cache folder of their own (for
a CPU without AVX-512, or to watch a helper process share the work): 30-90 s each of
one core's LLVM, and nothing they do touches the rest of the suite. Run in their turn
they kept the other core idle for ~170 s of a ~13-minute suite. So a test marked
``@pytest.mark.background("name")`` names a job registered here with ``@job``; the
session's conftest starts the collected tests' jobs, one after another on a thread of
their own, under ``nice -n 19`` so that the tests in front keep the CPU they need; the
test then takes the job's result (``result(name)``) and makes its assertions as before.
A job's processes inherit the niceness, and each job gets a fresh folder, removed at
the end of the session."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_JOBS: dict[str, Callable[[Path], object]] = {}
_RESULTS: dict[str, Future] = {}
_LIVE: set[subprocess.Popen] = set()
_DIRS: list[Path] = []
_LOCK = threading.Lock()


def job(fn: Callable[[Path], object]) -> Callable[[Path], object]:
    """Register ``fn(folder)`` as the job of its name: it runs its processes through
    ``python()`` and returns what its test asserts on."""
    _JOBS[fn.__name__] = fn
    return fn


def python(code: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """``code`` run by a fresh Python at the lowest priority, in the repository, with
    ``env`` over this process's environment (a None there removes the variable); its
    CompletedProcess, whatever its exit."""
    over = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full = {k: v for k, v in over.items() if v is not None}
    proc = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", code],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # its own process group, so that stop() ends a helper it started too; not a new
        # session: with the kernel's autogroups (sched_autogroup_enabled) a session is a
        # scheduling group of its own, where nice counts for nothing against the tests
        process_group=0,
    )
    with _LOCK:
        _LIVE.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
    finally:
        with _LOCK:
            _LIVE.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(names: list[str]) -> None:
    """Run the jobs ``names`` (those not started yet) one after another on a thread."""
    todo = []
    with _LOCK:
        for name in names:
            if name not in _RESULTS:
                _RESULTS[name] = Future()
                todo.append(name)
    if todo:
        threading.Thread(
            target=_run_all, args=(todo,), name="tests-background", daemon=True
        ).start()


def result(name: str, timeout: float = 1800):
    """The job's return value, once it has run; a job no conftest started (one test run
    alone by a harness without ours) starts now. Its exception, if it raised one."""
    if name not in _JOBS:
        raise KeyError(f"no background job named {name!r}")
    start([name])
    return _RESULTS[name].result(timeout=timeout)


def stop() -> None:
    """End every job's processes and remove the jobs' folders (the session is over)."""
    with _LOCK:
        live = list(_LIVE)
    for proc in live:
        _kill(proc)
    for folder in _DIRS:
        shutil.rmtree(folder, ignore_errors=True)


def _run_all(names: list[str]) -> None:
    for name in names:
        folder = Path(tempfile.mkdtemp(prefix=f"mixdesk-test-{name}-"))
        _DIRS.append(folder)
        try:
            _RESULTS[name].set_result(_JOBS[name](folder))
        except BaseException as e:  # the test re-raises it
            _RESULTS[name].set_exception(e)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
