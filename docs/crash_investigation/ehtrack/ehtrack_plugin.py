"""pytest plugin: write each test's id into the ehtrack log (LD_PRELOAD=ehtrack.so), so that a
registered-but-unmapped .eh_frame (a LEAK line) can be tied to the test that was running."""
import ctypes
import os

import pytest

_shim = ctypes.CDLL(os.environ["LD_PRELOAD"]) if "ehtrack" in os.environ.get("LD_PRELOAD", "") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _shim is not None:
        _shim.ehtrack_note(f"start {item.nodeid}".encode())
    yield
    if _shim is not None:
        _shim.ehtrack_note(f"end {item.nodeid}".encode())
