"""The result of a test's child process (one that needs its own XLA flags, e.g. 8 host devices).

The child prints one line ``REPORT <json>``; the parent takes the last such line. A bare "last line
of stdout" broke once in a fresh-clone ``make test`` (session 29): something in the child wrote a
stray ``x`` without a newline, so the JSON line began ``x{...``. The marker finds the report
wherever the line starts, and anything printed after the JSON on the same line is ignored.
"""

from __future__ import annotations

import json

MARKER = "REPORT "


def report_line(obj) -> str:
    """What the child prints: the marker, then ``obj`` as JSON."""
    return MARKER + json.dumps(obj)


def read_report(stdout: str):
    """The last report the child printed, decoded; fails naming what the child printed instead."""
    lines = [line for line in stdout.splitlines() if MARKER in line]
    assert lines, f"the child printed no {MARKER.strip()} line; its stdout ends: {stdout[-2000:]!r}"
    text = lines[-1].split(MARKER, 1)[1]
    return json.JSONDecoder().raw_decode(text)[0]
