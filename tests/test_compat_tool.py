"""tools/compat.py's report reading: the per-file table and the side-by-side comparison
with llama-server that the README quotes (the runs themselves are `make compat`)."""

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
