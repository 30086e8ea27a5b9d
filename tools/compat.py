"""``make compat``: llama.cpp's own server tests, run against Mixdesk.

The tests come from the pinned llama-cpp-python sdist (it vendors llama.cpp):
``tools/server/tests`` is extracted into the user cache dir (``compat/`` under
``core.paths.cache_dir()``, never the repository) and run unchanged, except
for one adapter of ours, the ``utils.py`` they import. It wraps upstream's
``utils.py`` (renamed ``_upstream_utils.py``) so that:

* ``ServerProcess.start`` runs ``main.py --headless`` with the flags the test built
  (Mixdesk refuses the ones it lacks by name, and that test then fails: a refusal is
  an honest answer, not a skip);
* every model preset is SmolLM2 (the embedded default model): no download, and
  ``--hf-repo/--hf-file/--offline`` are dropped; a LoRA file the tests download is
  replaced by the reference adapter lora_attn.gguf; two presets need what SmolLM2
  lacks: the infill preset (a story model with FIM tokens) runs Qwen2.5-Coder-0.5B
  (the catalogue's model with FIM tokens), and the embedding preset (bert-bge-small,
  whose file says pooling_type cls) gets ``--pooling cls`` unless the test sets one,
  since SmolLM2's file has no pooling_type (llama.cpp's default is then none);
* ``match_regex`` (the tests' check of the generated text against what their
  tiny story models write) only asks for a string: that text is model-specific.
  Nothing about the API (status codes, fields, counts of a request's own tokens)
  is relaxed.

Nothing from upstream is committed: the sdist is fetched with pip (or taken from
``--sdist``), the tests are extracted to the cache each run. The extra test
dependencies (filelock, wget, prometheus-client) go to its site/ folder, never
into the project's venv. Prints a per-file passed/failed table; ``--record FILE``
also writes every test's outcome per server as JSON (docs/compat-results.json is
the recorded run that tools/compat_docs.py turns into docs/compatibility.md).

    python tools/compat.py [--sdist FILE.tar.gz] [--files test_basic.py ...] [--all] [-k EXPR]
        [--vs-llama-server | --llama-server-bin PATH | --only-llama-server] [--record FILE]

A llama-server built beforehand is taken from ``--llama-server-bin`` or the
``MIXDESK_LLAMA_SERVER_BIN`` environment variable; otherwise ``--vs-llama-server``
builds one from the sdist in the same cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# the sdist, the extracted tests, their extra dependencies and a llama-server build live
# in the user cache (MIXDESK_CACHE moves it), never in the repository
WORK: Path | None = None  # --work: another folder (two runs at once must not share one)


def work_dir() -> Path:
    from core.paths import cache_dir

    return WORK or cache_dir() / "compat"


PIN = "llama-cpp-python==0.3.36"
SUBDIR = "vendor/llama.cpp/tools/server/tests/"
TEMPLATES = "vendor/llama.cpp/models/templates/"
EXTRA_DEPS = ["filelock", "wget", "prometheus-client"]
# the 13 files issue #20 measured llama-server on (208 passed, 10 failed); the sdist's
# other files test what Mixdesk does not claim (router mode, tools and MCP, vision,
# Anthropic/Responses/GCP APIs, reranking, sleep, speculative models): --all runs them
FILES = [
    "test_basic.py", "test_chat_completion.py", "test_completion.py", "test_ctx_shift.py",
    "test_embedding.py", "test_ignore_eos.py", "test_infill.py", "test_lora.py",
    "test_metrics.py", "test_security.py", "test_slot_save.py", "test_stream.py",
    "test_tokenize.py",
]  # fmt: skip

ADAPTER = r'''"""Mixdesk's adapter for llama.cpp's server tests (written by tools/compat.py)."""
import os
import subprocess as _subprocess
import sys
import types

import _upstream_utils as _up
from _upstream_utils import *  # noqa: F401,F403

MIXDESK = os.environ["MIXDESK_REPO"]
MODEL = os.environ["MIXDESK_MODEL"]
FIM_MODEL = os.environ.get("MIXDESK_FIM_MODEL") or MODEL
LORA = os.environ["MIXDESK_LORA"]
PYTHON = os.environ["MIXDESK_PYTHON"]
# set by --vs-llama-server: the same tests, presets and model through llama-server itself
SERVER_BIN = os.environ.get("MIXDESK_SERVER_BIN", "")
DROP_WITH_VALUE = {"--hf-repo", "--hf-file", "-hf", "-hff"}
DROP = {"--offline"}


def _translate(args):
    """llama-server's command line -> main.py --headless's."""
    out, i, has_model, hf = [], 1, False, ""
    while i < len(args):
        a = args[i]
        if a in DROP_WITH_VALUE:
            hf += " " + str(args[i + 1]) if i + 1 < len(args) else ""
            i += 2
            continue
        if a in DROP:
            i += 1
            continue
        if a in ("--model", "-m"):
            has_model = True
        if a == "--chat-template-file" and i + 1 < len(args):
            # upstream's path is relative to its tree: the file was extracted to templates/
            name = os.path.basename(args[i + 1])
            out += [a, os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", name)]
            i += 2
            continue
        if a == "--lora" and i + 1 < len(args) and not os.path.exists(args[i + 1]):
            out += ["--lora", LORA]
            i += 2
            continue
        out.append(a)
        i += 1
    if not has_model:
        out += ["--model", FIM_MODEL if "infill" in hf else MODEL]
    if "bert-bge" in hf and "--pooling" not in out:
        out += ["--pooling", "cls"]  # what the preset's own file says (pooling_type 2)
    if SERVER_BIN:
        return [SERVER_BIN, *out]
    return [PYTHON, os.path.join(MIXDESK, "main.py"), "--headless", *out]


class _Popen(_subprocess.Popen):
    def __init__(self, args, *a, **kw):
        if args and args[0] == "mixdesk-server":
            args = _translate(list(args))
            kw.pop("creationflags", None)
            kw["cwd"] = MIXDESK
        super().__init__(args, *a, **kw)


_up.subprocess = types.SimpleNamespace(**{**vars(_subprocess), "Popen": _Popen})
_up.ServerProcess.server_path = "mixdesk-server"


def _download_file(url, output_file_path=None):
    return LORA if url.endswith(".gguf") else _up.download_file(url, output_file_path)


def _match_regex(regex, text):  # the tests' story-model text is model-specific
    return isinstance(text, str)


_up.ServerPreset.load_all = staticmethod(lambda: None)  # nothing to download
_start = _up.ServerProcess.start


def _start_in_time(self, timeout_seconds=_up.DEFAULT_HTTP_TIMEOUT):
    # the infill preset's 260K-parameter story model becomes Qwen2.5-Coder-0.5B, which
    # loads in tens of seconds on a busy box: as upstream's own Qwen test, allow more
    if "infill" in f"{self.model_hf_repo} {self.model_hf_file}" and FIM_MODEL != MODEL:
        timeout_seconds = max(timeout_seconds, 300)
    return _start(self, timeout_seconds)


_up.ServerProcess.start = _start_in_time
download_file = _download_file
match_regex = _match_regex
'''


LOG_PLUGIN = '''"""Each test's outcome as soon as it is known (written by tools/compat.py): a run
stopped by its timeout may leave no junit report, and then these lines are the record."""
import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("MIXDESK_OUTCOMES")
    if not path or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = "skipped" if report.skipped else "failed" if report.failed else "passed"
    file, _, name = report.nodeid.partition("::")  # a parameter may hold "::" ([::1])
    with open(path, "a") as f:
        f.write(json.dumps([file.rsplit("/", 1)[-1], name, outcome]) + "\\n")
'''


def fetch_sdist(given: str | None) -> Path:
    if given:
        return Path(given)
    dl = work_dir() / "sdist"
    found = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PIN,
         "-d", str(dl)],
        check=True,
    )  # fmt: skip
    return sorted(dl.glob("llama_cpp_python-*.tar.gz"))[-1]


def extract_tests(sdist: Path) -> Path:
    dest = work_dir() / "tests"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            _, _, rel = m.name.partition("/")
            if not m.isfile():
                continue
            if rel.startswith(SUBDIR):
                target = dest / rel[len(SUBDIR) :]
            elif rel.startswith(TEMPLATES):  # the tests' --chat-template-file files
                target = dest / "templates" / rel[len(TEMPLATES) :]
            else:
                continue
            if not target.resolve().is_relative_to(dest.resolve()):
                continue  # a hostile member name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(m).read())
    (dest / "utils.py").rename(dest / "_upstream_utils.py")
    (dest / "utils.py").write_text(ADAPTER)
    (dest / "_mixdesk_log.py").write_text(LOG_PLUGIN)
    (dest / "tmp").mkdir(exist_ok=True)
    return dest


def ensure_deps() -> Path:
    site = work_dir() / "site"
    missing = [d for d in EXTRA_DEPS if not any(site.glob(d.replace("-", "_") + "*"))]
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site), *missing],
            check=True,
        )
    return site


def fim_model() -> Path | None:
    """Qwen2.5-Coder-0.5B for the infill tests, fetched once (``--get-model``'s
    catalogue); None (SmolLM2 then, and /infill answers 501) if it cannot be fetched."""
    from core import catalog

    name = "qwen2.5-coder-0.5b"
    if not catalog.is_fetched(name):
        try:
            catalog.fetch(name, progress=catalog.console_progress())
        except Exception as e:  # offline: the infill tests run on SmolLM2 and say 501
            print(f"compat: cannot fetch {name} ({e}); test_infill.py runs on SmolLM2")
            return None
    return catalog.model_path(name)


# Not -march=native: on a VM that advertises AMX (and AVX-512 FP16) without enabling
# them, a native build dies with SIGILL at its first matmul (seen here). AVX2/FMA/F16C
# run on any recent x86-64 (the flags are ignored elsewhere); AVX-512 and its VNNI/BF16
# are added where the CPU lists them, so bench/weights.py's side-by-side figures compare
# with llama.cpp's fast kernels on this CPU, not its AVX2 ones. AMX stays off.
PORTABLE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
            "-DGGML_F16C=ON"]  # fmt: skip
AVX512 = {"avx512f": "-DGGML_AVX512=ON", "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
          "avx512_bf16": "-DGGML_AVX512_BF16=ON"}  # fmt: skip


def cpu_build_flags() -> list[str]:
    """PORTABLE plus the AVX-512 flags /proc/cpuinfo lists (Linux; elsewhere PORTABLE)."""
    try:
        have = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        have = set()
    extra = [flag for name, flag in AVX512.items() if name in have]
    return PORTABLE + (extra if "-DGGML_AVX512=ON" in extra else [])


def build_llama_server(sdist: Path) -> Path:
    """llama-server itself, built once from the same sdist's vendored llama.cpp (CPU,
    Release, no web UI download: the machine may be offline) into the cache folder; the
    comparison then runs llama.cpp's tests against the real thing on the same model,
    presets and adapter. Nothing of it is committed."""
    binary = work_dir() / "llama-server-build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = work_dir() / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        prefix = "vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                _, _, rel = m.name.partition("/")
                if not rel.startswith(prefix) or not (m.isfile() or m.isdir()):
                    continue
                target = src / rel[len(prefix) :]
                if not target.resolve().is_relative_to(src.resolve()):
                    continue  # a hostile member name
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(m).read())
                target.chmod(m.mode & 0o755 | 0o600)
    build = binary.parents[1]
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
         "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_CURL=OFF", *cpu_build_flags()],
        check=True,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        [
            "nice",
            "-n",
            "10",
            "cmake",
            "--build",
            str(build),
            "--target",
            "llama-server",
            "-j",
            jobs,
        ],
        check=True,
    )
    return binary


def run(
    tests: Path, files: list[str], keyword: str | None, timeout: int, server_bin: Path | None
) -> Path:
    from core.default_model import ensure_default_model

    model = ensure_default_model(log=print)
    fim = fim_model()
    report = work_dir() / ("report-llama-server.xml" if server_bin else "report.xml")
    report.unlink(missing_ok=True)
    log = report.with_suffix(".jsonl")
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(work_dir() / "site"), str(tests)]),
        "MIXDESK_REPO": str(REPO),
        "MIXDESK_MODEL": str(model),
        "MIXDESK_FIM_MODEL": str(fim) if fim else "",
        "MIXDESK_LORA": str(REPO / "tests/data/llamacpp/adapters/lora_attn.gguf"),
        "MIXDESK_PYTHON": sys.executable,
        "MIXDESK_SERVER_BIN": str(server_bin or ""),
        "PORT": os.environ.get("PORT", "18080"),
        "MIXDESK_OUTCOMES": str(log),
    }
    # a file name runs the file; "file.py::test[id]" runs that one test
    targets = [f"unit/{f}" for f in files] if files else ["unit"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_mixdesk_log",
           f"--junitxml={report}", "-o", "junit_family=xunit1", *targets]  # fmt: skip
    if keyword:
        cmd += ["-k", keyword]
    proc = subprocess.Popen(cmd, cwd=tests, env=env)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # an interrupted pytest still writes its report: the table covers what ran
        print(f"compat: stopping after {timeout} s; the table covers the tests that ran")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return report


def collect(report: Path) -> dict[tuple[str, str], str] | None:
    """A run's outcomes: its junit report, or, when a stopped run left none, the lines
    the _mixdesk_log plugin wrote as each test finished (None: nothing ran)."""
    if report.exists():
        return outcomes(report)
    log = report.with_suffix(".jsonl")
    if not log.exists():
        return None
    out: dict[tuple[str, str], str] = {}
    for line in log.read_text().splitlines():
        file, name, outcome = json.loads(line)
        if out.get((file, name)) != "failed":  # a teardown error after a pass is a failure
            out[(file, name)] = outcome
    return out


def outcomes(report: Path) -> dict[tuple[str, str], str]:
    """(file, test name) -> "passed" | "failed" | "skipped", from pytest's junit report."""
    out: dict[tuple[str, str], str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        # classname "unit.test_basic" (the case pytest was in when interrupted has none)
        parts = [p for p in (case.get("classname") or "").split(".") if p.startswith("test_")]
        if not parts:
            continue
        if case.find("skipped") is not None:
            result = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            result = "failed"
        else:
            result = "passed"
        out[(parts[0] + ".py", case.get("name") or "")] = result
    return out


def table(runs: dict[str, dict[tuple[str, str], str]]) -> str:
    """A per-file passed/failed/skipped table, one group of columns per server."""
    names = list(runs)
    files = sorted({f for r in runs.values() for f, _ in r})
    kinds = ("passed", "failed", "skipped")
    multi = len(names) > 1
    head = [f"{n} {k}" if multi else k for n in names for k in kinds]
    rows = ["| file | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    total = [0] * len(head)
    for f in files:
        cells = [
            sum(1 for (ff, _), v in runs[n].items() if ff == f and v == k)
            for n in names
            for k in kinds
        ]
        total = [a + b for a, b in zip(total, cells, strict=True)]
        rows.append(f"| {f} | " + " | ".join(map(str, cells)) + " |")
    rows.append("| **total** | " + " | ".join(f"**{t}**" for t in total) + " |")
    return "\n".join(rows)


def differences(ours: dict, theirs: dict) -> str:
    """The tests llama-server passes and Mixdesk does not, and the other way round."""
    lines = []
    for title, a, b in (
        ("llama-server passes, Mixdesk does not", theirs, ours),
        ("Mixdesk passes, llama-server does not", ours, theirs),
    ):
        diff = sorted(k for k, v in a.items() if v == "passed" and b.get(k) != "passed")
        lines.append(f"{title} ({len(diff)}):")
        lines += [f"  {f}::{name} ({b.get((f, name), 'not run')})" for f, name in diff]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", help=f"the {PIN} sdist (default: pip download it)")
    ap.add_argument(
        "--files",
        nargs="*",
        default=[],
        help="unit test files (default: the 13 of FILES), or single tests as file.py::name",
    )
    ap.add_argument("--all", action="store_true", help="every unit test file of the sdist")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for each run")
    ap.add_argument(
        "--vs-llama-server",
        action="store_true",
        help="also run the tests against llama-server itself (built once from the sdist, "
        "or --llama-server-bin) on the same model and adapter, and compare",
    )
    ap.add_argument(
        "--llama-server-bin",
        default=os.environ.get("MIXDESK_LLAMA_SERVER_BIN"),
        help="a llama-server binary built beforehand to compare against "
        "(default: $MIXDESK_LLAMA_SERVER_BIN)",
    )
    ap.add_argument(
        "--only-llama-server", action="store_true", help="run llama-server's column only"
    )
    ap.add_argument(
        "--record",
        metavar="FILE",
        help="also write every test's outcome per server to FILE (JSON); a server this run "
        "did not test keeps its recorded column (docs/compat-results.json is the recorded run)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        help="the folder for the sdist, extracted tests and builds (default: compat/ in the "
        "user cache dir); two runs at once need one each",
    )
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if a.work:
        global WORK
        WORK = a.work.resolve()
    sdist = fetch_sdist(a.sdist)
    tests = extract_tests(sdist)
    ensure_deps()
    files = a.files or ([] if a.all else FILES)
    runs: dict[str, dict] = {}
    if a.vs_llama_server or a.llama_server_bin or a.only_llama_server:
        binary = Path(a.llama_server_bin) if a.llama_server_bin else build_llama_server(sdist)
        got = collect(run(tests, files, a.keyword, a.timeout, binary))
        if got is not None:
            runs["llama-server"] = got
    if not a.only_llama_server:
        got = collect(run(tests, files, a.keyword, a.timeout, None))
        if got is not None:
            runs["Mixdesk"] = got
    if not runs:
        print("compat: no report (pytest did not run)")
        return 1
    print(table(runs))
    if len(runs) == 2:
        print(differences(runs["Mixdesk"], runs["llama-server"]))
    if a.record:
        record(Path(a.record), runs, ["python tools/compat.py", *(argv or sys.argv[1:])])
    return 0


def record(path: Path, runs: dict[str, dict[tuple[str, str], str]], command: list[str]) -> None:
    """Add each server's per-test outcomes to the JSON at ``path``: {"servers": {name:
    {"file::test": outcome}}, "commands": {name: [command lines]}}. A test this run did
    not reach keeps its recorded outcome and a server this run did not test keeps its
    column, so one record may join several runs (each command is listed)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["pin"] = PIN
    servers = data.setdefault("servers", {})
    commands = data.setdefault("commands", {})
    line = " ".join(command)
    for name, got in runs.items():
        column = servers.setdefault(name, {})
        column.update({f"{f}::{t}": v for (f, t), v in got.items()})
        servers[name] = dict(sorted(column.items()))
        done = commands.get(name, [])
        done = [done] if isinstance(done, str) else done
        commands[name] = done + ([line] if line not in done else [])
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"compat: recorded {', '.join(runs)} in {path}")


if __name__ == "__main__":
    sys.exit(main())
