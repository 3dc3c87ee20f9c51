"""SQLiteBatchStore: the Batch API's default store, one SQLite file in WAL mode.

Several processes may open the same file: a batch is run by the one worker holding its lease
(``lease_owner``, ``lease_expires_at``), taken in a ``BEGIN IMMEDIATE`` transaction (SQLite's
write lock serializes the takers) and renewed by :meth:`heartbeat`. A worker that dies (SIGKILL)
stops renewing; once the lease expires another worker, or the same server restarted, takes the
batch and runs only the lines that have no result. A result is written only while its worker
still holds the lease, in the transaction that marks the line done and counts it.
"""

from __future__ import annotations

import json
import pathlib
import sqlite3
import threading
import time

from jaxinfer.batch_api.records import BatchRecord, ClaimedLine, FileRecord, InputLine, now_s
from jaxinfer.batch_api.result_lines import expired_line, result_files
from jaxinfer.batch_api.store import result_file_ids

DEFAULT_LEASE_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, record TEXT NOT NULL,
    status TEXT NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT, lease_expires_at REAL);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, custom_id TEXT, body TEXT,
    result TEXT, is_error INTEGER, PRIMARY KEY (batch_id, line_index));
CREATE INDEX IF NOT EXISTS pending_lines ON lines (batch_id, line_index) WHERE result IS NULL;
"""
_RUNNING = ("validating", "in_progress")


class SQLiteBatchStore:
    """See the module docstring; one connection, used under a lock by every thread of the process."""

    def __init__(self, path: str | pathlib.Path, lease_s: float = DEFAULT_LEASE_S):
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.lease_s = lease_s
        # isolation_level=None: no implicit transactions; each write below opens its own.
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a recorded result survives a power cut too
            self._db.executescript(_SCHEMA)

    def _write(self):
        return _Transaction(self._db, self._lock)

    def add_file(self, record: FileRecord, content: bytes) -> None:
        with self._write() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                       (record.id, record.filename, record.purpose, record.bytes, record.created_at, content))

    def get_file(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute("SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?",
                                   (file_id,)).fetchone()
        return None if row is None else FileRecord(*row)

    def read_file(self, file_id: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def add_batch(self, batch: BatchRecord, lines: list[InputLine]) -> None:
        batch.total = len(lines)
        batch.failed = sum(line.result is not None for line in lines)
        with self._write() as db:
            db.execute("INSERT INTO batches (id, record, status, failed) VALUES (?, ?, ?, ?)",
                       (batch.id, _dump(batch), batch.status, batch.failed))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?)", [
                (batch.id, line.index, line.custom_id, None if line.body is None else json.dumps(line.body),
                 None if line.result is None else json.dumps(line.result), None if line.result is None else 1)
                for line in lines])

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                                   (batch_id,)).fetchone()
        return None if row is None else _load(*row)

    def list_batches(self, limit: int, after: str | None) -> list[BatchRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record, status, completed, failed FROM batches WHERE seq < COALESCE("
                "(SELECT seq FROM batches WHERE id = ?), 9223372036854775807) ORDER BY seq DESC LIMIT ?",
                (after, limit)).fetchall()
        return [_load(*row) for row in rows]

    def cancel_batch(self, batch_id: str) -> BatchRecord | None:
        with self._write() as db:
            row = db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                             (batch_id,)).fetchone()
            if row is None:
                return None
            batch = _load(*row)
            if batch.status in _RUNNING:
                batch.status, batch.cancelling_at = "cancelling", now_s()
                db.execute("UPDATE batches SET record = ?, status = ? WHERE id = ?",
                           (_dump(batch), batch.status, batch_id))
            return batch

    def claim_lines(self, worker_id: str, max_lines: int, held: set[tuple[str, int]]) -> list[ClaimedLine]:
        claimed: list[ClaimedLine] = []
        now = time.time()
        with self._write() as db:
            candidates = db.execute(
                "SELECT id, record, status, completed, failed FROM batches WHERE status IN (?, ?) "
                "AND (lease_owner = ? OR lease_owner IS NULL OR lease_expires_at < ?) ORDER BY seq",
                (*_RUNNING, worker_id, now)).fetchall()
            for batch_id, record, status, completed, failed in candidates:
                if len(claimed) >= max_lines:
                    break
                skip = sorted(i for b, i in held if b == batch_id)
                rows = db.execute(
                    f"SELECT line_index, custom_id, body FROM lines WHERE batch_id = ? AND result IS NULL "
                    f"AND line_index NOT IN ({','.join('?' * len(skip))}) ORDER BY line_index LIMIT ?",
                    (batch_id, *skip, max_lines - len(claimed))).fetchall()
                if not rows:
                    continue
                batch = _load(record, status, completed, failed)
                if batch.status == "validating":
                    batch.status, batch.in_progress_at = "in_progress", now_s()
                db.execute("UPDATE batches SET record = ?, status = ?, lease_owner = ?, lease_expires_at = ? "
                           "WHERE id = ?", (_dump(batch), batch.status, worker_id, now + self.lease_s, batch_id))
                claimed += [ClaimedLine(batch_id, index, custom_id, batch.endpoint, json.loads(body))
                            for index, custom_id, body in rows]
        return claimed

    def heartbeat(self, worker_id: str, lines: list[ClaimedLine]) -> None:
        # Only the batches of lines it holds: a worker whose engine died holds none, and its leases lapse.
        batch_ids = {line.batch_id for line in lines}
        if not batch_ids:
            return
        with self._write() as db:
            db.execute(f"UPDATE batches SET lease_expires_at = ? WHERE lease_owner = ? AND status = 'in_progress' "
                       f"AND id IN ({','.join('?' * len(batch_ids))})",
                       (time.time() + self.lease_s, worker_id, *batch_ids))

    def runnable_batches(self, worker_id: str, batch_ids: set[str]) -> set[str]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE status = 'in_progress' AND lease_owner = ? "
                f"AND id IN ({','.join('?' * len(batch_ids))})", (worker_id, *batch_ids)).fetchall()
        return {row[0] for row in rows}

    def record_result(self, worker_id: str, line: ClaimedLine, result: dict, is_error: bool) -> bool:
        with self._write() as db:
            written = db.execute(
                "UPDATE lines SET result = ?, is_error = ? WHERE batch_id = ? AND line_index = ? AND result IS NULL "
                "AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND lease_owner = ? AND status = 'in_progress')",
                (json.dumps(result, ensure_ascii=False), int(is_error), line.batch_id, line.index,
                 line.batch_id, worker_id)).rowcount
            if written:
                counter = "failed" if is_error else "completed"
                db.execute(f"UPDATE batches SET {counter} = {counter} + 1 WHERE id = ?", (line.batch_id,))
            return bool(written)

    def finalize_batches(self, worker_id: str) -> list[str]:
        now = time.time()
        with self._lock:
            ready = self._db.execute(
                "SELECT id FROM batches b WHERE (lease_owner = ? OR lease_owner IS NULL OR lease_expires_at < ?) "
                "AND (status IN ('cancelling', 'finalizing') OR (status IN (?, ?) AND (NOT EXISTS "
                "(SELECT 1 FROM lines WHERE batch_id = b.id AND result IS NULL) "
                "OR json_extract(record, '$.expires_at') <= ?)))",
                (worker_id, now, *_RUNNING, now)).fetchall()
        return [batch_id for (batch_id,) in ready if self._finalize(batch_id)]

    def _finalize(self, batch_id: str) -> bool:
        # "finalizing" is committed first, so a batch whose files are being written says so (and no
        # result is recorded any more); a worker killed here leaves it "finalizing", and the next
        # finalize_batches call finishes it. A batch whose window closed with lines unanswered is
        # marked expired (expired_at) in the same step: its remaining lines will not run.
        with self._write() as db:
            batch = _load(*db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                                      (batch_id,)).fetchone())
            if batch.status in _RUNNING:
                batch.status, batch.finalizing_at = "finalizing", now_s()
                batch.in_progress_at = batch.in_progress_at or batch.finalizing_at
                if batch.expires_at is not None and batch.expires_at <= time.time() and db.execute(
                        "SELECT 1 FROM lines WHERE batch_id = ? AND result IS NULL", (batch_id,)).fetchone():
                    batch.expired_at = batch.finalizing_at
                db.execute("UPDATE batches SET record = ?, status = ? WHERE id = ?",
                           (_dump(batch), batch.status, batch_id))
        with self._write() as db:
            batch = _load(*db.execute("SELECT record, status, completed, failed FROM batches WHERE id = ?",
                                      (batch_id,)).fetchone())
            if batch.status not in ("finalizing", "cancelling"):
                return False
            if batch.status == "finalizing" and batch.expired_at is not None:
                batch.failed += self._expire_lines(db, batch_id)
                db.execute("UPDATE batches SET failed = ? WHERE id = ?", (batch.failed, batch_id))
            results = [json.loads(r) for (r,) in db.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND result IS NOT NULL ORDER BY line_index",
                (batch_id,))]
            now = now_s()
            for file_id, content, kind in zip(result_file_ids(batch_id), result_files(results), ("output", "error")):
                if content:
                    db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                               (file_id, f"{batch_id}_{kind}.jsonl", "batch_output", len(content), now, content))
                    setattr(batch, f"{kind}_file_id", file_id)
            if batch.status == "cancelling":
                batch.status, batch.cancelled_at = "cancelled", now
            elif batch.expired_at is not None:
                batch.status = "expired"
            else:
                batch.status, batch.completed_at = "completed", now
            db.execute("UPDATE batches SET record = ?, status = ?, lease_owner = NULL WHERE id = ?",
                       (_dump(batch), batch.status, batch_id))
        return True

    @staticmethod
    def _expire_lines(db: sqlite3.Connection, batch_id: str) -> int:
        """Give each unanswered line its ``batch_expired`` error-file line; returns how many."""
        unanswered = db.execute("SELECT line_index, custom_id FROM lines WHERE batch_id = ? AND result IS NULL",
                                (batch_id,)).fetchall()
        db.executemany("UPDATE lines SET result = ?, is_error = 1 WHERE batch_id = ? AND line_index = ?",
                       [(json.dumps(expired_line(batch_id, index, custom_id)), batch_id, index)
                        for index, custom_id in unanswered])
        return len(unanswered)

    def num_pending_lines(self) -> int:
        with self._lock:
            return self._db.execute(
                "SELECT COUNT(*) FROM lines l JOIN batches b ON b.id = l.batch_id "
                "WHERE l.result IS NULL AND b.status IN (?, ?)", _RUNNING).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Transaction:
    """``with``: the process lock plus one ``BEGIN IMMEDIATE`` transaction (committed, or rolled back on error)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock):
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type, *_) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()


def _dump(batch: BatchRecord) -> str:
    # The counters and the status live in their own columns, updated in place; the JSON holds the rest.
    return json.dumps({k: v for k, v in vars(batch).items() if k not in ("status", "completed", "failed")})


def _load(record: str, status: str, completed: int, failed: int) -> BatchRecord:
    return BatchRecord(**json.loads(record), status=status, completed=completed, failed=failed)
