"""Exactly once across SIGKILL: real server processes killed mid-batch and restarted on the same store.

The driver is ``benchmarks/batch_durability.py`` (which runs more cycles for the report); here a
few cycles must lose nothing, duplicate nothing, record no aborted answer, and re-run only lines
that were in flight at a kill.
"""

import sys

import pytest

from tests.conftest import REPO
from tests.redis_server import RedisServer

sys.path.insert(0, str(REPO / "benchmarks"))
import batch_durability  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def check_exactly_once(result: dict, cycles: int) -> None:
    assert (result["lost"], result["duplicated"], result["unexpected"], result["not_finished"]) == (0, 0, 0, 0), result
    counts = result["request_counts"]
    assert counts == {"total": result["lines"], "completed": result["lines"], "failed": 0}, result
    assert result["reruns"] <= result["max_reruns_allowed"] and result["max_runs_of_a_line"] <= 1 + cycles, result


def test_a_server_killed_three_times_resumes_its_batch_exactly_once(tmp_path):
    result = batch_durability.run_cycles(tmp_path, ["--batch-db", str(tmp_path / "batches.db")], cycles=3,
                                         num_lines=80, timeout_s=240)
    check_exactly_once(result, cycles=3)


def test_with_redis_a_killed_workers_lines_are_finished_by_another_once(tmp_path):
    redis = RedisServer(tmp_path)
    try:
        result = batch_durability.run_cycles(tmp_path, ["--batch-redis", redis.url], cycles=2, num_lines=60,
                                             num_servers=2, timeout_s=240)
    finally:
        redis.stop()
    check_exactly_once(result, cycles=2)
