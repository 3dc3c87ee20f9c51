"""RedisBatchStore: one queue of batch lines shared by several servers, on Redis Streams.

Each line to run is an entry of one stream, read through one consumer group: a server's runner
is a consumer (``XREADGROUP``), so each entry goes to one runner, and stays in the group's
pending list until the result is recorded (``XACK`` in the same Lua script that writes it). A
runner renews its entries' idle time while it runs them (``XCLAIM`` to itself); entries idle past
``lease_s`` belonged to a worker that died and are taken over by another (``XAUTOCLAIM``).
Results are written with ``HSETNX``, so the first result of a line is its only one even if a
worker presumed dead comes back; each batch's counters move in the same script.

Keys (under ``prefix``): ``file:{id}`` (hash: record, content), ``batch:{id}`` (hash: one field
per :class:`BatchRecord` field), ``batch:{id}:lines`` and ``batch:{id}:results`` (hashes by line
number), ``batches`` (sorted set by creation order, for listing), ``active`` (set of unfinished
batches), ``lines`` (the stream).
"""

from __future__ import annotations

import dataclasses
import json

import redis

from jaxinfer.batch_api.records import BatchRecord, ClaimedLine, FileRecord, InputLine, now_s
from jaxinfer.batch_api.result_lines import expired_line, result_files
from jaxinfer.batch_api.store import result_file_ids

GROUP = "batch-runners"
_RAW_FIELDS = ("status", "completed", "failed")  # stored as plain strings so the scripts can test and count them

# KEYS: batch hash. ARGV: now.
_START = """
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1])
end
"""
# KEYS: results hash, batch hash, stream. ARGV: line number, result, is_error, group, entry id.
_RECORD = """
redis.call('XACK', KEYS[3], ARGV[4], ARGV[5])
redis.call('XDEL', KEYS[3], ARGV[5])
if redis.call('HGET', KEYS[2], 'status') ~= 'in_progress' then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3] == '1' and 'failed' or 'completed', 1)
return 1
"""
# KEYS: batch hash. ARGV: now. Returns the status after.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
end
"""
# KEYS: batch hash. ARGV: now. Every line answered, or the window closed: "finalizing" (no result is
# recorded any more); closed with lines unanswered: expired_at set too.
_BEGIN_FINALIZE = """
local b = redis.call('HMGET', KEYS[1], 'status', 'total', 'completed', 'failed', 'in_progress_at', 'expires_at')
if b[1] ~= 'validating' and b[1] ~= 'in_progress' then return end
local answered = tonumber(b[2]) == tonumber(b[3]) + tonumber(b[4])
local expires_at = tonumber(b[6])
local expired = not answered and expires_at ~= nil and expires_at <= tonumber(ARGV[1])
if answered or expired then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[1])
  if b[5] == 'null' then redis.call('HSET', KEYS[1], 'in_progress_at', ARGV[1]) end
  if expired then redis.call('HSET', KEYS[1], 'expired_at', ARGV[1]) end
end
"""
# KEYS: results hash, batch hash. ARGV: line number, its batch_expired result. Counted once.
_EXPIRE_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then redis.call('HINCRBY', KEYS[2], 'failed', 1) end
"""
# KEYS: batch hash, active set. ARGV: batch id, now, output file id, error file id (JSON values).
_END_FINALIZE = """
local status = redis.call('HGET', KEYS[1], 'status')
local expired_at = redis.call('HGET', KEYS[1], 'expired_at')
if status == 'finalizing' and expired_at and expired_at ~= 'null' then
  redis.call('HSET', KEYS[1], 'status', 'expired')
elseif status == 'finalizing' then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'completed_at', ARGV[2])
elseif status == 'cancelling' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancelled_at', ARGV[2])
else
  return 0
end
redis.call('HSET', KEYS[1], 'output_file_id', ARGV[3], 'error_file_id', ARGV[4])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""


class RedisBatchStore:
    """See the module docstring."""

    def __init__(self, url: str, lease_s: float = 30.0, prefix: str = "jaxinfer:batch_api:"):
        self.lease_s = lease_s
        self.prefix = prefix
        self._redis = redis.Redis.from_url(url, socket_timeout=30)
        self._stream = prefix + "lines"
        try:
            self._redis.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):  # the group exists: another server made it
                raise
        self._start = self._redis.register_script(_START)
        self._record = self._redis.register_script(_RECORD)
        self._cancel = self._redis.register_script(_CANCEL)
        self._begin_finalize = self._redis.register_script(_BEGIN_FINALIZE)
        self._end_finalize = self._redis.register_script(_END_FINALIZE)
        self._expire_line = self._redis.register_script(_EXPIRE_LINE)

    def _batch_key(self, batch_id: str, part: str = "") -> str:
        return f"{self.prefix}batch:{batch_id}{part}"

    def add_file(self, record: FileRecord, content: bytes) -> None:
        self._redis.hset(f"{self.prefix}file:{record.id}",
                         mapping={"record": json.dumps(dataclasses.asdict(record)), "content": content})

    def get_file(self, file_id: str) -> FileRecord | None:
        record = self._redis.hget(f"{self.prefix}file:{file_id}", "record")
        return None if record is None else FileRecord(**json.loads(record))

    def read_file(self, file_id: str) -> bytes | None:
        return self._redis.hget(f"{self.prefix}file:{file_id}", "content")

    def add_batch(self, batch: BatchRecord, lines: list[InputLine]) -> None:
        batch.total = len(lines)
        batch.failed = sum(line.result is not None for line in lines)
        seq = self._redis.incr(self.prefix + "batch_seq")
        runnable = [line for line in lines if line.result is None]
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._batch_key(batch.id), mapping=_encode(batch))
            if runnable:
                pipe.hset(self._batch_key(batch.id, ":lines"), mapping={
                    line.index: json.dumps({"custom_id": line.custom_id, "body": line.body}) for line in runnable})
            if len(runnable) < len(lines):
                pipe.hset(self._batch_key(batch.id, ":results"), mapping={
                    line.index: json.dumps(line.result) for line in lines if line.result is not None})
            pipe.zadd(self.prefix + "batches", {batch.id: seq})
            pipe.sadd(self.prefix + "active", batch.id)
            for line in runnable:
                pipe.xadd(self._stream, {"batch": batch.id, "index": line.index})
            pipe.execute()

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        fields = self._redis.hgetall(self._batch_key(batch_id))
        return _decode(fields) if fields else None

    def list_batches(self, limit: int, after: str | None) -> list[BatchRecord]:
        top = "+inf"
        if after is not None:
            score = self._redis.zscore(self.prefix + "batches", after)
            top = "+inf" if score is None else f"({score}"
        ids = self._redis.zrevrangebyscore(self.prefix + "batches", top, "-inf", start=0, num=limit)
        return [b for b in (self.get_batch(i.decode()) for i in ids) if b is not None]

    def cancel_batch(self, batch_id: str) -> BatchRecord | None:
        self._cancel(keys=[self._batch_key(batch_id)], args=[now_s()])
        return self.get_batch(batch_id)

    def claim_lines(self, worker_id: str, max_lines: int, held: set[tuple[str, int]]) -> list[ClaimedLine]:
        _, entries, _ = self._redis.xautoclaim(self._stream, GROUP, worker_id, int(self.lease_s * 1000),
                                               start_id="0-0", count=max_lines)
        if len(entries) < max_lines:
            for _, fresh in self._redis.xreadgroup(GROUP, worker_id, {self._stream: ">"},
                                                   count=max_lines - len(entries)) or []:
                entries += fresh
        claimed = []
        for entry_id, fields in entries:
            batch_id, index = fields[b"batch"].decode(), int(fields[b"index"])
            if (batch_id, index) in held:
                continue
            status = self._redis.hget(self._batch_key(batch_id), "status")
            if status not in (b"validating", b"in_progress") or self._redis.hexists(
                    self._batch_key(batch_id, ":results"), index):
                self._redis.xack(self._stream, GROUP, entry_id)  # cancelled, or already answered
                self._redis.xdel(self._stream, entry_id)
                continue
            self._start(keys=[self._batch_key(batch_id)], args=[now_s()])
            line = json.loads(self._redis.hget(self._batch_key(batch_id, ":lines"), index))
            endpoint = json.loads(self._redis.hget(self._batch_key(batch_id), "endpoint"))
            claimed.append(ClaimedLine(batch_id, index, line["custom_id"], endpoint, line["body"],
                                       receipt=entry_id.decode()))
        return claimed

    def heartbeat(self, worker_id: str, lines: list[ClaimedLine]) -> None:
        if lines:  # claiming an entry again for its own consumer resets its idle time
            self._redis.xclaim(self._stream, GROUP, worker_id, 0, [line.receipt for line in lines], justid=True)

    def runnable_batches(self, worker_id: str, batch_ids: set[str]) -> set[str]:
        return {b for b in batch_ids if self._redis.hget(self._batch_key(b), "status") == b"in_progress"}

    def record_result(self, worker_id: str, line: ClaimedLine, result: dict, is_error: bool) -> bool:
        keys = [self._batch_key(line.batch_id, ":results"), self._batch_key(line.batch_id), self._stream]
        args = [line.index, json.dumps(result, ensure_ascii=False), int(is_error), GROUP, line.receipt]
        return self._record(keys=keys, args=args) == 1

    def finalize_batches(self, worker_id: str) -> list[str]:
        done = []
        for raw_id in self._redis.smembers(self.prefix + "active"):
            batch_id = raw_id.decode()
            key = self._batch_key(batch_id)
            self._begin_finalize(keys=[key], args=[now_s()])
            status, expired_at = self._redis.hmget(key, "status", "expired_at")
            if status not in (b"finalizing", b"cancelling"):
                continue
            if status == b"finalizing" and expired_at not in (None, b"null"):
                self._expire_unanswered(batch_id)
            stored = self._redis.hgetall(self._batch_key(batch_id, ":results"))
            results = [json.loads(stored[k]) for k in sorted(stored, key=int)]
            file_ids = []
            for file_id, content, kind in zip(result_file_ids(batch_id), result_files(results), ("output", "error")):
                if content:  # same id, same content: a second worker finalizing at once writes the same file
                    self.add_file(FileRecord(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", len(content),
                                             now_s()), content)
                file_ids.append(json.dumps(file_id if content else None))
            if self._end_finalize(keys=[key, self.prefix + "active"], args=[batch_id, now_s(), *file_ids]):
                done.append(batch_id)
        return done

    def _expire_unanswered(self, batch_id: str) -> None:
        """Give each unanswered line its ``batch_expired`` error-file line (idempotent: HSETNX)."""
        results_key = self._batch_key(batch_id, ":results")
        answered = set(self._redis.hkeys(results_key))
        for index, raw in self._redis.hgetall(self._batch_key(batch_id, ":lines")).items():
            if index not in answered:
                result = expired_line(batch_id, int(index), json.loads(raw)["custom_id"])
                self._expire_line(keys=[results_key, self._batch_key(batch_id)], args=[int(index), json.dumps(result)])

    def num_pending_lines(self) -> int:
        pending = 0
        for raw_id in self._redis.smembers(self.prefix + "active"):
            status, total, completed, failed = self._redis.hmget(
                self._batch_key(raw_id.decode()), "status", "total", "completed", "failed")
            if status in (b"validating", b"in_progress"):
                pending += int(json.loads(total)) - int(completed) - int(failed)
        return pending

    def close(self) -> None:
        self._redis.close()


def _encode(batch: BatchRecord) -> dict:
    return {k: (str(v) if k in _RAW_FIELDS else json.dumps(v)) for k, v in dataclasses.asdict(batch).items()}


def _decode(fields: dict) -> BatchRecord:
    values = {}
    for k, v in fields.items():
        name = k.decode()
        values[name] = v.decode() if name == "status" else int(v) if name in _RAW_FIELDS else json.loads(v)
    return BatchRecord(**values)
