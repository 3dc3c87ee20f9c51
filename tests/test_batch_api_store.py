"""Both BatchStores keep the same contract: results exactly once, claims that exclude other live
workers and pass to another once a worker stops renewing them, files built from the results.
And the runner's priority rule, against a client whose queue the test sets."""

import json
import time

import pytest

from jaxinfer.batch_api.records import BatchRecord, FileRecord, new_id, now_s
from jaxinfer.batch_api.result_lines import parse_input_file, response_line
from jaxinfer.batch_api.sqlite_store import SQLiteBatchStore
from jaxinfer.batch_api.store import BatchStore
from jaxinfer.engine_client import OutputStream
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.batch_runner import BatchRunner, BatchRunnerConfig
from tests.fake_engine import load_tiny_tokenizer
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)
LEASE_S = 1.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request, tmp_path):
    """Opens a store; every call opens another handle on the same data (another process's view)."""
    opened = []

    def open_one():
        if request.param == "sqlite":
            store = SQLiteBatchStore(tmp_path / "batches.db", lease_s=LEASE_S)
        else:
            from jaxinfer.batch_api.redis_store import RedisBatchStore

            store = RedisBatchStore(request.getfixturevalue("redis_server").url, lease_s=LEASE_S)
        opened.append(store)
        return store
    if request.param == "redis":
        request.getfixturevalue("redis_server").flush()
    yield open_one
    for store in opened:
        store.close()


def add_batch(store, num_lines: int, extra: bytes = b"", expires_at: int | None = None) -> BatchRecord:
    content = b"".join(b'{"custom_id": "c%d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}\n'
                       % i for i in range(num_lines)) + extra
    file = FileRecord(new_id("file"), "in.jsonl", "batch", len(content), now_s())
    store.add_file(file, content)
    batch = BatchRecord(new_id("batch"), "/v1/completions", file.id, "24h", now_s(),
                        expires_at=now_s() + 3600 if expires_at is None else expires_at)
    store.add_batch(batch, parse_input_file(batch.id, content, batch.endpoint))
    return batch


def answer(store, worker, line, text="ok") -> bool:
    result = response_line(line.batch_id, line.index, line.custom_id, 200, {"text": text})
    return store.record_result(worker, line, result, is_error=False)


def test_each_line_is_recorded_once_and_the_files_hold_one_line_each(open_store):
    store = open_store()
    assert isinstance(store, BatchStore)  # the whole interface
    batch = add_batch(store, 3, extra=b"not json\n")
    assert store.get_batch(batch.id).failed == 1 and store.num_pending_lines() == 3
    lines = store.claim_lines("w1", 10, set())
    assert sorted(line.custom_id for line in lines) == ["c0", "c1", "c2"]
    assert store.get_batch(batch.id).status == "in_progress"
    assert store.claim_lines("w1", 10, {line.key for line in lines}) == []
    assert answer(store, "w1", lines[0]) and not answer(store, "w1", lines[0], text="again")
    assert store.finalize_batches("w1") == []  # two lines still unanswered
    for line in lines[1:]:
        assert answer(store, "w1", line)
    assert store.num_pending_lines() == 0
    assert store.finalize_batches("w1") == [batch.id]
    done = store.get_batch(batch.id)
    assert (done.status, done.total, done.completed, done.failed) == ("completed", 4, 3, 1)
    output = store.read_file(done.output_file_id).decode().splitlines()
    assert len(output) == 3 and '"again"' not in "".join(output)
    assert "invalid_json_line" in store.read_file(done.error_file_id).decode()
    assert store.get_file(done.output_file_id).bytes == len(store.read_file(done.output_file_id))
    assert store.finalize_batches("w1") == []


def test_a_live_workers_claim_excludes_others_and_a_dead_ones_passes_on(open_store):
    first, second = open_store(), open_store()
    add_batch(first, 4)
    held = first.claim_lines("w1", 2, set())
    assert len(held) == 2
    if isinstance(first, SQLiteBatchStore):  # the lease is the whole batch's
        assert second.claim_lines("w2", 10, set()) == []
    else:  # the stream hands each entry to one consumer
        assert {line.key for line in second.claim_lines("w2", 10, set())}.isdisjoint({line.key for line in held})
    for _ in range(5):  # a live worker keeps its claim past the lease
        time.sleep(LEASE_S / 4)
        first.heartbeat("w1", held)
    assert not {line.key for line in second.claim_lines("w2", 10, set())} & {line.key for line in held}
    assert answer(first, "w1", held[0])
    time.sleep(LEASE_S * 1.5)  # w1 dies: no more heartbeats
    taken = second.claim_lines("w2", 10, set())
    assert held[1].key in {line.key for line in taken} and held[0].key not in {line.key for line in taken}
    for line in taken:
        assert answer(second, "w2", line)
    late = answer(first, "w1", held[1], text="late")  # w1 was only slow: its result must not be a second one
    assert not late
    assert second.finalize_batches("w2") != [] or first.finalize_batches("w1") != []


def test_cancel_stops_claims_and_finalizes_with_what_was_done(open_store):
    store = open_store()
    batch = add_batch(store, 3)
    [line] = store.claim_lines("w1", 1, set())
    assert answer(store, "w1", line)
    assert store.cancel_batch(batch.id).status == "cancelling"
    assert store.runnable_batches("w1", {batch.id}) == set()
    assert store.claim_lines("w1", 10, {line.key}) == []
    assert store.finalize_batches("w1") == [batch.id]
    done = store.get_batch(batch.id)
    assert (done.status, done.completed, done.error_file_id) == ("cancelled", 1, None)
    assert len(store.read_file(done.output_file_id).splitlines()) == 1
    assert store.cancel_batch(batch.id).status == "cancelled"


def test_a_batch_past_its_window_expires_and_its_unanswered_lines_fail_as_batch_expired(open_store):
    store = open_store()
    batch = add_batch(store, 4, extra=b"not json\n", expires_at=int(time.time()) + 2)
    running = add_batch(store, 1)  # its window is open: untouched
    lines = [line for line in store.claim_lines("w1", 10, set()) if line.batch_id == batch.id]
    assert answer(store, "w1", lines[0]) and answer(store, "w1", lines[1])
    assert store.finalize_batches("w1") == []  # two lines left, the window still open
    time.sleep(max(0.0, batch.expires_at - time.time()) + 0.1)
    assert store.finalize_batches("w1") == [batch.id]
    assert not answer(store, "w1", lines[2])  # the line still running when it expired is not recorded
    done = store.get_batch(batch.id)
    assert (done.status, done.total, done.completed, done.failed) == ("expired", 5, 2, 3)
    assert done.expired_at >= done.expires_at and done.completed_at is None
    body = done.to_openai()
    assert body["expired_at"] == done.expired_at and body["expires_at"] == batch.expires_at
    assert len(store.read_file(done.output_file_id).splitlines()) == 2
    errors = [json.loads(x) for x in store.read_file(done.error_file_id).splitlines()]
    assert sorted(e["custom_id"] for e in errors if e["error"]["code"] == "batch_expired") == ["c2", "c3"]
    assert [e["error"]["code"] for e in errors].count("invalid_json_line") == 1
    assert all(e["response"] is None for e in errors)
    assert store.get_batch(running.id).status == "in_progress"
    assert store.finalize_batches("w1") == [] and store.num_pending_lines() == 1


def test_list_pages_newest_first(open_store):
    store = open_store()
    ids = [add_batch(store, 1).id for _ in range(5)]
    assert [b.id for b in store.list_batches(2, None)] == ids[::-1][:2]
    assert [b.id for b in store.list_batches(10, ids[2])] == ids[1::-1]
    assert store.get_batch("batch_unknown") is None and store.get_file("file-unknown") is None


class HeldClient:
    """An EngineClient whose requests finish only when the test releases them; the test sets how
    many requests wait in its queue."""

    def __init__(self):
        self.tokenizer, _ = load_tiny_tokenizer()
        self.max_model_len = 64
        self.state = "ready"
        self.num_waiting = 0
        self.streams: dict[str, OutputStream] = {}

    def generate(self, requests):
        stream = OutputStream([r.request_id for r in requests])
        for r in requests:
            self.streams[r.request_id] = stream
        return stream

    score = generate

    def abort(self, request_ids):
        pass

    def stats(self):
        return {"num_waiting": self.num_waiting, "server_num_requests_waiting": 0}

    def release_all(self):
        for request_id, stream in self.streams.items():
            sample = CompletionOutput(index=0, text="x", token_ids=[1], finish_reason="length")
            stream.put(RequestOutput(request_id, "p", [1], [sample], finished=True))
        self.streams.clear()


def test_the_runner_submits_only_while_the_interactive_queue_is_short(tmp_path):
    store = SQLiteBatchStore(tmp_path / "batches.db")
    batch = add_batch(store, 10)
    client = HeldClient()
    config = BatchRunnerConfig(max_lines_in_flight=3, max_waiting_requests=2, housekeeping_s=0.0)
    runner = BatchRunner(store, client, "model", config=config, worker_id="w1")
    client.num_waiting = 2  # interactive requests queue: the batch waits
    runner.run_once()
    assert client.streams == {}
    client.num_waiting = 0
    runner.run_once()
    assert len(client.streams) == 3  # at most max_lines_in_flight
    client.release_all()
    runner.run_once()  # collects the 3 (recorded), submits 3 more
    assert store.get_batch(batch.id).completed == 3 and len(client.streams) == 3
    client.num_waiting = 5
    client.release_all()
    runner.run_once()
    assert store.get_batch(batch.id).completed == 6 and client.streams == {}
    client.num_waiting = 0
    for _ in range(3):
        runner.run_once()
        client.release_all()
    runner.run_once()
    runner.run_once()
    assert store.get_batch(batch.id).status == "completed"
    store.close()


def test_a_dead_engine_lets_its_claims_lapse_to_another_server(tmp_path):
    store = SQLiteBatchStore(tmp_path / "batches.db", lease_s=LEASE_S)
    batch = add_batch(store, 4)
    client = HeldClient()
    config = BatchRunnerConfig(max_lines_in_flight=2, heartbeat_s=0.0, housekeeping_s=0.0)
    runner = BatchRunner(store, client, "model", config=config, worker_id="w1")
    runner.run_once()
    assert len(client.streams) == 2
    other = SQLiteBatchStore(tmp_path / "batches.db", lease_s=LEASE_S)
    client.state = "dead"
    deadline = time.monotonic() + 5 * LEASE_S
    while not (taken := other.claim_lines("w2", 10, set())):  # a live runner would renew the lease forever
        assert time.monotonic() < deadline, "the dead engine's server kept its lease"
        runner.run_once()
        time.sleep(0.05)
    assert len(taken) == 4 and store.get_batch(batch.id).completed == 0
    store.close()
    other.close()
