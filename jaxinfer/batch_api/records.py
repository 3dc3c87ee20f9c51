"""The Batch API's stored objects (files, batches, lines) and the JSON shapes OpenAI gives them.

Every store (:mod:`~jaxinfer.batch_api.store`) keeps these same records; the routes turn them into
the ``file`` and ``batch`` objects the ``openai`` SDK parses with :meth:`FileRecord.to_openai` and
:meth:`BatchRecord.to_openai`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}  # what clients may send, as OpenAI: only "24h"
BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
# A batch is one of these; the runner only works on the active ones.
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES = ("completed", "failed", "cancelled", "expired")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}" if prefix == "file" else f"{prefix}_{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


@dataclasses.dataclass
class FileRecord:
    id: str
    filename: str
    purpose: str  # "batch" for uploads; "batch_output" for the files a batch writes
    bytes: int
    created_at: int

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


@dataclasses.dataclass
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    metadata: dict | None = None
    status: str = "validating"
    total: int = 0
    completed: int = 0  # lines answered with status 200 (in the output file)
    failed: int = 0  # lines in the error file
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    # When the window closes (set on creation; None only in records stored before expiry existed):
    # a batch still running then becomes "expired", its unanswered lines in the error file.
    expires_at: int | None = None
    expired_at: int | None = None

    def to_openai(self) -> dict:
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at or self.created_at + COMPLETION_WINDOW_S[self.completion_window],
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }


@dataclasses.dataclass
class InputLine:
    """One line of a batch's input file, as the upload left it.

    ``body`` is the request to run; a line refused on upload (bad JSON, no ``custom_id``, another
    URL) has no body and its ``result`` (an error-file line) is known at once.
    """

    index: int  # the line's number in the input file, from 0
    custom_id: str | None
    body: dict | None
    result: dict | None = None


@dataclasses.dataclass(frozen=True)
class ClaimedLine:
    """A line a runner took from the store to run; ``receipt`` is the store's handle on the claim."""

    batch_id: str
    index: int
    custom_id: str
    endpoint: str
    body: dict
    receipt: str | None = None  # Redis: the stream entry id; SQLite: None (the batch holds the lease)

    @property
    def key(self) -> tuple[str, int]:
        return self.batch_id, self.index
