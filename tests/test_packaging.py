"""Packaging checks that stay fast (no PyInstaller build; `make package` does that):
pyproject pins == requirements.txt, the .desktop file and its icons, the PyInstaller
spec's data dirs, and a real wheel build + `pip install --target` of this checkout."""

from __future__ import annotations

import ast
import configparser
import os
import re
import shutil
import struct
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SPEC = REPO / "packaging" / "mixdesk.spec"
DESKTOP = REPO / "resources" / "mixdesk.desktop"
ICON_SIZES = (16, 32, 48, 128, 256)
RESOURCE_DIRS = (
    "resources/adapters",
    "resources/vectors",
    "resources/icons",
    "resources/styles",
    "resources/webui",
)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(lines) -> dict[str, str]:
    """{canonical name: version} of `name==version` lines; anything else is an error."""
    pins = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        assert m, f"not an exact pin: {raw!r}"
        pins[_canon(m.group(1))] = m.group(2)
    return pins


def test_pyproject_dependencies_equal_requirements_pins():
    req = _pins((REPO / "requirements.txt").read_text(encoding="utf-8").splitlines())
    proj = _pins(PYPROJECT["project"]["dependencies"])
    assert proj == req


def test_requirements_package_pins_pyinstaller_on_top_of_runtime():
    lines = (REPO / "requirements-package.txt").read_text(encoding="utf-8").splitlines()
    assert "-r requirements.txt" in [ln.strip() for ln in lines]
    pins = _pins(lines)
    assert "pyinstaller" in pins and "pyinstaller-hooks-contrib" in pins


def test_pyproject_ships_every_package_and_the_entry_point():
    st = PYPROJECT["tool"]["setuptools"]
    found = {
        str(p.parent.relative_to(REPO)).replace(os.sep, ".")
        for top in ("core", "ui")
        for p in (REPO / top).rglob("__init__.py")
    }
    assert found <= set(st["packages"]), "a new sub-package is missing from pyproject.toml"
    assert "resources" in st["packages"] and st["py-modules"] == ["main"]
    assert PYPROJECT["project"]["scripts"] == {"mixdesk": "main:main"}


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_desktop_file_keys_and_icon():
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str
    cp.read(DESKTOP, encoding="utf-8")
    entry = cp["Desktop Entry"]
    for key in ("Type", "Name", "Exec", "Icon", "Categories", "Terminal"):
        assert entry.get(key), f"{DESKTOP.name}: missing {key}"
    assert entry["Type"] == "Application"
    assert entry["Exec"].split()[0] == "mixdesk"  # the console script name
    assert entry["StartupWMClass"] == "mixdesk"  # ui/app.py setDesktopFileName
    icon = entry["Icon"]
    assert "/" not in icon and "." not in icon, "Icon is a theme name, not a path"
    icons = REPO / "resources" / "icons"
    assert (
        (icons / f"{icon}.svg").read_text(encoding="utf-8").lstrip().startswith(("<svg", "<?xml"))
    )
    for s in ICON_SIZES:
        assert _png_size(icons / f"{icon}-{s}.png") == (s, s)
    validator = shutil.which("desktop-file-validate")
    if validator:
        r = subprocess.run([validator, str(DESKTOP)], capture_output=True, text=True)
        assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def _spec_assign(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{SPEC.name}: no {name} = ... literal")


def test_pyinstaller_spec_parses_and_bundles_the_resources():
    tree = ast.parse(SPEC.read_text(encoding="utf-8"), filename=str(SPEC))
    data_dirs = _spec_assign(tree, "DATA_DIRS")
    # same relative place as in the checkout, so ui/util.py's RESOURCES resolves in the bundle
    assert sorted(data_dirs) == sorted((d, d) for d in RESOURCE_DIRS)
    patterns = _spec_assign(tree, "DATA_PATTERNS")
    for src, _ in data_dirs:
        assert list((REPO / src).glob(patterns[src])), f"{src}/{patterns[src]} matches nothing"
    assert "torch" in _spec_assign(tree, "excludes")
    calls = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert {"Analysis", "PYZ", "EXE", "COLLECT"} <= calls


def _can_build_without_isolation() -> bool:
    """setuptools >= 70.1 builds wheels itself; older needs `wheel` (else use isolation)."""
    try:
        import setuptools

        if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1):
            return True
        import wheel  # noqa: F401

        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    """A wheel of a copy of the checkout (the build's own build/ and egg-info stay out of it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    src.mkdir()
    for name in ("pyproject.toml", "main.py"):
        shutil.copy2(REPO / name, src / name)
    for name in ("core", "ui", "resources"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        "-w",
        str(tmp / "out"),
        str(src),
    ]
    if _can_build_without_isolation():
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp / "out").glob("mixdesk-*.whl")
    return whl


def test_wheel_contains_packages_resources_and_entry_point(built_wheel):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    expected = {"main.py"}
    for top in ("core", "ui"):
        expected |= {p.relative_to(REPO).as_posix() for p in (REPO / top).rglob("*.py")}
    for d in RESOURCE_DIRS:
        expected |= {
            p.relative_to(REPO).as_posix()
            for p in (REPO / d).iterdir()
            if p.is_file() and p.suffix != ".py"
        }
    assert expected - names == set()
    assert not [n for n in names if n.split("/")[0] in ("tests", "tools", "bench", "packaging")]
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(built_wheel).read(ep).decode()
    assert re.search(r"^\[console_scripts\]\s*\nmixdesk = main:main$", text, re.M), text


def test_installed_wheel_finds_resources_and_runs(built_wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--target",
            str(target),
            str(built_wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # Run from elsewhere with only the installed copy on the path (not the checkout).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), QT_QPA_PLATFORM="offscreen")
    probe = (
        "import ui.util as u, main; "
        "print(u.RESOURCES); print(main.__file__); "
        "print(sorted(p.name for p in (u.RESOURCES / 'adapters').glob('*.gguf')))"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res, main_file, adapters = r.stdout.splitlines()
    assert Path(res) == target / "resources" and Path(main_file).parent == target
    assert adapters == str(sorted(p.name for p in (REPO / "resources" / "adapters").glob("*.gguf")))
    script = target / "bin" / "mixdesk"
    assert script.is_file()
    r = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "--headless" in r.stdout, r.stderr[-3000:]
