"""tools/compat.py's report reading: the per-file table and the side-by-side comparison
with llama-server that the README quotes (the runs themselves are `make compat`)."""

import json

from tools import compat

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="unit.test_basic" name="test_server_start_simple"/>
<testcase classname="unit.test_basic" name="test_server_props"><failure message="x"/></testcase>
<testcase classname="unit.test_lora" name="test_lora[0.0-x]"><skipped message="slow"/></testcase>
<testcase classname="unit.test_lora" name="test_lora[1.0-y]"><error message="boom"/></testcase>
<testcase classname="" name="interrupted"/>
</testsuite></testsuites>
"""


def _report(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return compat.outcomes(path)


def test_outcomes_read_passed_failed_errored_and_skipped(tmp_path):
    got = _report(tmp_path, "r.xml", REPORT)
    assert got == {
        ("test_basic.py", "test_server_start_simple"): "passed",
        ("test_basic.py", "test_server_props"): "failed",
        ("test_lora.py", "test_lora[0.0-x]"): "skipped",
        ("test_lora.py", "test_lora[1.0-y]"): "failed",  # an error counts as a failure
    }  # the interrupted case (no file) is left out


def test_one_server_gives_the_plain_table(tmp_path):
    text = compat.table({"Mixdesk": _report(tmp_path, "r.xml", REPORT)})
    assert text.splitlines() == [
        "| file | passed | failed | skipped |",
        "|---|---:|---:|---:|",
        "| test_basic.py | 1 | 1 | 0 |",
        "| test_lora.py | 0 | 1 | 1 |",
        "| **total** | **1** | **2** | **1** |",
    ]


def test_two_servers_are_compared_file_by_file_and_test_by_test(tmp_path):
    ours = _report(tmp_path, "ours.xml", REPORT)
    theirs = _report(
        tmp_path,
        "theirs.xml",
        REPORT.replace('<failure message="x"/>', "").replace(
            'name="test_server_start_simple"/>',
            'name="test_server_start_simple"><failure message="y"/></testcase>',
        ),
    )
    text = compat.table({"llama-server": theirs, "Mixdesk": ours})
    lines = text.splitlines()
    assert lines[0].startswith("| file | llama-server passed | llama-server failed |")
    assert "| Mixdesk passed | Mixdesk failed | Mixdesk skipped |" in lines[0]
    assert lines[2] == "| test_basic.py | 1 | 1 | 0 | 1 | 1 | 0 |"
    diff = compat.differences(ours, theirs)
    assert diff.splitlines() == [
        "llama-server passes, Mixdesk does not (1):",
        "  test_basic.py::test_server_props (failed)",
        "Mixdesk passes, llama-server does not (1):",
        "  test_basic.py::test_server_start_simple (failed)",
    ]


def test_a_stopped_run_without_a_junit_report_is_read_from_the_outcome_log(tmp_path):
    """A run stopped by its timeout may leave no junit report: the lines the plugin
    wrote as each test finished are the record (a teardown error after a pass fails)."""
    report = tmp_path / "report.xml"
    assert compat.collect(report) is None  # nothing ran
    report.with_suffix(".jsonl").write_text(
        '["test_basic.py", "test_a", "passed"]\n'
        '["test_security.py", "test_b[http://[::1]:3000]", "passed"]\n'
        '["test_security.py", "test_b[http://[::1]:3000]", "failed"]\n'
        '["test_lora.py", "test_c", "skipped"]\n'
    )
    assert compat.collect(report) == {
        ("test_basic.py", "test_a"): "passed",
        ("test_security.py", "test_b[http://[::1]:3000]"): "failed",
        ("test_lora.py", "test_c"): "skipped",
    }
    report.write_text(REPORT)  # a junit report, when there is one, wins
    assert ("test_basic.py", "test_server_props") in compat.collect(report)


def test_record_adds_a_run_to_the_json_and_keeps_what_it_did_not_run(tmp_path):
    path = tmp_path / "results.json"
    first = {("test_basic.py", "test_a"): "failed", ("test_lora.py", "test_c"): "passed"}
    compat.record(path, {"Mixdesk": first}, ["python", "tools/compat.py", "--record", "x"])
    compat.record(path, {"llama-server": {("test_basic.py", "test_a"): "passed"}}, ["run2"])
    compat.record(path, {"Mixdesk": {("test_basic.py", "test_a"): "passed"}}, ["rerun"])
    data = json.loads(path.read_text())
    assert data["pin"] == compat.PIN
    assert data["servers"]["Mixdesk"] == {
        "test_basic.py::test_a": "passed",  # the re-run's outcome is the last
        "test_lora.py::test_c": "passed",  # not re-run: kept
    }
    assert data["servers"]["llama-server"] == {"test_basic.py::test_a": "passed"}
    assert data["commands"]["Mixdesk"] == ["python tools/compat.py --record x", "rerun"]
    assert data["commands"]["llama-server"] == ["run2"]


def test_the_work_folder_is_the_user_cache_not_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXDESK_CACHE", str(tmp_path))
    assert compat.work_dir() == tmp_path / "compat"
    assert not compat.work_dir().resolve().is_relative_to(compat.REPO)
