"""The README and the guide in docs/ keep working as they move: every relative link
(files and #anchors) resolves, and every `make X` they tell a reader to run is a target
of the Makefile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); the target ends at the first space or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
MAKE = re.compile(r"(?<![\w./-])make\s+([a-z][a-z0-9_-]*)")


def docs() -> list[Path]:
    """The pages a reader follows: README.md, CHANGELOG.md and docs/*.md."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return pages + ([REPO / "CHANGELOG.md"] if (REPO / "CHANGELOG.md").exists() else [])


def split_code(text: str) -> tuple[list[str], list[str]]:
    """(prose lines with inline code removed, code: fenced blocks' lines and inline spans)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced:
            code.append(line)
            continue
        code += INLINE_CODE.findall(line)
        prose.append(INLINE_CODE.sub("", line))
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a page (outside code blocks), with GitHub's -1, -2 suffixes
    for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    prose, _ = split_code(page.read_text(encoding="utf-8"))
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that does not resolve, as 'target: why'."""
    text = page.read_text(encoding="utf-8")
    prose, _ = split_code(text)
    bad = []
    for target in LINK.findall("\n".join(prose)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def make_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z][\w.-]*)\s*:(?!=)", line)
        if m:
            targets.add(m.group(1))
    return targets


def named_make_targets(page: Path) -> set[str]:
    """The X of every `make X` in a page's code (inline spans and code blocks)."""
    _, code = split_code(page.read_text(encoding="utf-8"))
    return {m for chunk in code for m in MAKE.findall(chunk)}


@pytest.mark.parametrize("page", docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_named_exists(page):
    assert named_make_targets(page) - make_targets() == set()


def test_the_readme_names_the_two_commands_and_links_every_guide_page():
    readme = REPO / "README.md"
    assert {"run", "test"} <= named_make_targets(readme)
    linked = {t.partition("#")[0] for t in LINK.findall(readme.read_text(encoding="utf-8"))}
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README does not link {page.name}"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 300


def test_the_checker_finds_a_broken_file_a_broken_anchor_and_an_unknown_target(tmp_path):
    """The checks above must be able to fail: a page with a missing file, a missing
    heading and a `make` target the Makefile lacks is reported on each count."""
    (tmp_path / "README.md").write_text("# Project\n\n## Two commands\n")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Title\n\n[gone](nowhere.md) [bad anchor](../README.md#no-such-heading) "
        "[good](../README.md#two-commands) [self](#title) [web](https://example.org/x)\n\n"
        "```sh\n[not a link](in-code.md)\nmake frobnicate\n```\n\nRun `make test`.\n"
    )
    assert broken_links(page) == [
        "nowhere.md: no such file",
        "../README.md#no-such-heading: no heading #no-such-heading in README.md",
    ]
    assert named_make_targets(page) - make_targets() == {"frobnicate"}


def test_anchors_follow_githubs_rules():
    assert slug("Parity with llama.cpp") == "parity-with-llamacpp"
    assert slug("X/Y grid tab") == "xy-grid-tab"
    assert slug("llama.cpp's own server tests (`make compat`)") == (
        "llamacpps-own-server-tests-make-compat"
    )
    assert slug("Mixes: the global one and per-request ones") == (
        "mixes-the-global-one-and-per-request-ones"
    )
