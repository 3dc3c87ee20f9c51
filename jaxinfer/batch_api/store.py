"""BatchStore: where files, batches and each line's result live, durably, for the routes and the runner.

Two implementations: :class:`~jaxinfer.batch_api.sqlite_store.SQLiteBatchStore` (the default: one
file, a lease per batch so two processes never run the same batch at once) and
:class:`~jaxinfer.batch_api.redis_store.RedisBatchStore` (several servers share one queue: a
stream and a consumer group, entries of a dead worker reclaimed after a timeout).

Exactly once comes from the store, not the runner: :meth:`BatchStore.record_result` writes a
line's result only if the line has none yet, in the same transaction that marks it done, and
:meth:`BatchStore.claim_lines` only offers lines without a result. A process killed at any point
re-runs at most the lines it had in flight; the output and error files are built from the stored
results at the end (:meth:`BatchStore.finalize_batches`), one line per input line.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

from jaxinfer.batch_api.records import BatchRecord, ClaimedLine, FileRecord, InputLine


def result_file_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files: fixed per batch, so finalizing twice writes the same files."""
    digest = hashlib.sha256(batch_id.encode()).hexdigest()
    return f"file-{digest[:24]}out", f"file-{digest[24:48]}err"


@runtime_checkable
class BatchStore(Protocol):
    """Files, batches and line results; every method is safe to call from any thread."""

    def add_file(self, record: FileRecord, content: bytes) -> None: ...

    def get_file(self, file_id: str) -> FileRecord | None: ...

    def read_file(self, file_id: str) -> bytes | None: ...

    def add_batch(self, batch: BatchRecord, lines: list[InputLine]) -> None:
        """Store a new batch ("validating") and its lines; lines refused on upload count as failed at once."""

    def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    def list_batches(self, limit: int, after: str | None) -> list[BatchRecord]:
        """Newest first, at most ``limit``, starting after the batch ``after`` (a cursor)."""

    def cancel_batch(self, batch_id: str) -> BatchRecord | None:
        """A validating or in-progress batch becomes "cancelling"; others are returned unchanged."""

    def claim_lines(self, worker_id: str, max_lines: int, held: set[tuple[str, int]]) -> list[ClaimedLine]:
        """Up to ``max_lines`` lines without a result that no other live worker holds, for ``worker_id``
        to run; ``held`` are the (batch id, line) keys it already runs, not offered again."""

    def heartbeat(self, worker_id: str, lines: list[ClaimedLine]) -> None:
        """Keep ``worker_id``'s claims alive (call well within the lease)."""

    def runnable_batches(self, worker_id: str, batch_ids: set[str]) -> set[str]:
        """Which of ``batch_ids`` ``worker_id`` may go on running (not cancelled, claim not lost)."""

    def record_result(self, worker_id: str, line: ClaimedLine, result: dict, is_error: bool) -> bool:
        """Store the line's result and mark it done, atomically; False (nothing written) if it already
        has one, or its batch no longer runs here."""

    def finalize_batches(self, worker_id: str) -> list[str]:
        """Batches with every line answered become "completed", "cancelling" ones "cancelled": their
        output and error files are written from the stored results. Returns their ids."""

    def num_pending_lines(self) -> int:
        """Lines of active batches without a result (the pending-lines gauge)."""

    def close(self) -> None: ...
