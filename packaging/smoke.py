"""Smoke test of the packaged app (run by `make package` after the build).

    python packaging/smoke.py [dist/mixdesk/mixdesk]

1. headless: `mixdesk --headless --port P`, poll GET /health until {"status": "ok"},
   then generate a few tokens with POST /completion; SIGTERM must exit with 0.
   The matrix kernels it compiled must be cached in the user cache dir.
2. GUI: `QT_QPA_PLATFORM=offscreen mixdesk --port P` with the window's API server
   switched on in its (isolated) settings, poll /health until ok and /lora-adapters
   until the three demo adapters from the bundle's resources/ are loaded.

The bundle has no pip, so it cannot fetch the default model itself (see
README, "Installing Mixdesk"): the model cache is pre-seeded from the checkout's cache
(`python -m core.default_model`) through MIXDESK_CACHE, and settings go to a
throw-away MIXDESK_HOME so the user's own are never touched.
Run with the project venv's Python from the repo root (it imports core.default_model).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_ADAPTERS = sorted(p.name for p in (REPO / "resources" / "adapters").glob("*.gguf"))
TIMEOUT = float(os.environ.get("MIXDESK_SMOKE_TIMEOUT", "180"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, None


def wait_for(what: str, proc: subprocess.Popen, check) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < TIMEOUT:
        if proc.poll() is not None:
            raise SystemExit(f"smoke: the app exited with {proc.returncode} before {what}")
        if check():
            return time.monotonic() - t0
        time.sleep(0.25)
    raise SystemExit(f"smoke: no {what} within {TIMEOUT:.0f} s")


def seeded_cache(tmp: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from core.default_model import MODEL_FILENAME, ensure_default_model

    src = ensure_default_model(log=lambda m: print(f"smoke: {m}", file=sys.stderr))
    cache = tmp / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / MODEL_FILENAME).symlink_to(src)
    return cache


def launch(binary: Path, args: list[str], env: dict, log: Path) -> subprocess.Popen:
    out = open(log, "wb")
    return subprocess.Popen(
        [str(binary), *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def show_log(log: Path) -> None:
    print(f"---- {log} ----\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)


def headless(binary: Path, env: dict, tmp: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "headless.log"
    t0 = time.monotonic()
    proc = launch(binary, ["--headless", "--port", str(port)], env, log)
    try:
        wait_for(
            "/health ok", proc, lambda: http("GET", base + "/health") == (200, {"status": "ok"})
        )
        ready = time.monotonic() - t0
        status, out = http(
            "POST",
            base + "/completion",
            {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0},
        )
        if status != 200 or not isinstance(out, dict) or not out.get("content"):
            raise SystemExit(f"smoke: /completion answered {status} {out!r}")
        print(f"smoke: headless ready in {ready:.1f} s; /completion -> {out['content']!r}")
    except BaseException:
        stop(proc)
        show_log(log)
        raise
    code = stop(proc)
    if code != 0:
        show_log(log)
        raise SystemExit(f"smoke: headless exited with {code} on SIGTERM (expected 0)")


def kernels_cached(cache: Path) -> None:
    """The headless start compiled the matrix kernels and cached them in the user cache
    dir (so the next start loads them): numba caches only a function whose source
    file it finds, which the spec's module_collection_mode provides."""
    index = sorted((cache / "numba").rglob("*.nbi"))
    if not index:
        raise SystemExit(f"smoke: no compiled kernels cached under {cache / 'numba'}")
    print(f"smoke: {len(index)} compiled kernels cached in {cache / 'numba'}")


def gui(binary: Path, env: dict, tmp: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    home = Path(env["MIXDESK_HOME"])
    (home / "config").mkdir(parents=True, exist_ok=True)
    # The window starts its API server at launch when it was on last time.
    (home / "config" / "settings.json").write_text(
        json.dumps({"server": {"host": "127.0.0.1", "port": port, "api_key": "", "enabled": True}})
    )
    log = tmp / "gui.log"
    t0 = time.monotonic()
    proc = launch(binary, ["--port", str(port)], {**env, "QT_QPA_PLATFORM": "offscreen"}, log)

    def demo_adapters_loaded() -> bool:
        status, out = http("GET", base + "/lora-adapters")
        paths = [Path(a.get("path", "")) for a in out] if status == 200 and out else []
        # loaded from the bundle's own resources/, not from the checkout
        return sorted(p.name for p in paths) == DEMO_ADAPTERS and all(
            p.resolve().is_relative_to(binary.parent.resolve()) for p in paths
        )

    try:
        wait_for(
            "/health ok from the window's server",
            proc,
            lambda: http("GET", base + "/health") == (200, {"status": "ok"}),
        )
        wait_for(f"demo adapters {DEMO_ADAPTERS}", proc, demo_adapters_loaded)
        print(
            f"smoke: GUI (offscreen) ready with {len(DEMO_ADAPTERS)} demo adapters "
            f"in {time.monotonic() - t0:.1f} s"
        )
    except BaseException:
        stop(proc)
        show_log(log)
        raise
    stop(proc)  # Qt installs no SIGTERM handler: the window just ends (code -15)
    text = log.read_text(errors="replace")
    if "Traceback" in text:
        show_log(log)
        raise SystemExit("smoke: the GUI logged a traceback")


def main() -> int:
    binary = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "dist" / "mixdesk" / "mixdesk")
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"smoke: no packaged binary at {binary} (run make package)")
    with tempfile.TemporaryDirectory(prefix="mixdesk-smoke-") as d:
        tmp = Path(d)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "QT_", "MIXDESK_", "NUMBA_"))
        }
        env.update(MIXDESK_CACHE=str(seeded_cache(tmp)), MIXDESK_HOME=str(tmp / "home"))
        headless(binary, env, tmp)
        kernels_cached(Path(env["MIXDESK_CACHE"]))
        gui(binary, env, tmp)
    print("smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
