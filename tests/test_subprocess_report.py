"""The child-process report reader: a fresh-clone test run once saw a stray ``x`` before the JSON."""

import pytest

from .subprocess_report import read_report, report_line


def test_reads_the_last_report_past_stray_output_on_its_line():
    stdout = "\n".join(["warming up", report_line({"run": 1}), "x" + report_line({"run": 2}) + "tail", "bye"])
    assert read_report(stdout) == {"run": 2}


def test_a_child_without_a_report_fails_showing_its_output():
    with pytest.raises(AssertionError, match="no REPORT line.*only noise"):
        read_report("only noise\n")
