"""docs/compatibility.md cannot drift from the recorded `make compat` run: it is what
tools/compat_docs.py writes from docs/compat-results.json, every test Mixdesk fails
(or that llama-server and Mixdesk disagree on) carries a reason, and no reason is left
over from a test that no longer fails."""

from __future__ import annotations

import copy

from tools import compat_docs


def test_the_page_is_what_the_recorded_run_generates():
    data = compat_docs.load()
    assert compat_docs.PAGE.read_text(encoding="utf-8") == compat_docs.render(data), (
        "docs/compatibility.md is stale: run .venv/bin/python tools/compat_docs.py"
    )


def test_every_failure_and_difference_has_a_reason_and_no_reason_is_stale():
    assert compat_docs.problems(compat_docs.load()) == []


def test_a_new_failure_without_a_reason_is_reported():
    data = copy.deepcopy(compat_docs.load())
    name = "test_basic.py::test_a_new_case_nobody_explained"
    for results in data["servers"].values():
        results[name] = "failed"
    data["servers"]["Mixdesk"][name] = "failed"
    assert f"no reason for {name}" in compat_docs.problems(data)
    assert f"`{name}`" in compat_docs.render(data)


def test_a_file_no_route_claims_is_reported():
    data = copy.deepcopy(compat_docs.load())
    data["servers"]["Mixdesk"]["test_router.py::test_x"] = "passed"
    assert "no route section claims test_router.py" in compat_docs.problems(data)
