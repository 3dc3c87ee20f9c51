"""OpenAI's Files and Batch API: ``/v1/files`` and ``/v1/batches``, over the app's BatchStore.

Uploads (``POST /v1/files``, multipart, purpose ``batch``) may be larger than any other body:
their limit is ``--max-file-bytes`` (waitress and Flask both apply it to this path only). Creating
a batch checks the input file as a whole (JSONL, at most 50,000 lines) and the endpoint, then
stores it with its lines; the :class:`~jaxinfer.server.batch_runner.BatchRunner` runs them. The
output and error files are ordinary files (``GET /v1/files/{id}/content``). A batch still
running when its completion window closes (``expires_at``) becomes ``expired``: the runner's
finalizing pass gives its unanswered lines ``batch_expired`` error lines (OpenAI's semantics).
"""

from __future__ import annotations

import json
import math
import time

from flask import Blueprint, Response, request

from jaxinfer.batch_api.records import COMPLETION_WINDOW_S, ENDPOINTS, BatchRecord, FileRecord, new_id, now_s
from jaxinfer.batch_api.result_lines import InputFileError, parse_input_file
from jaxinfer.batch_api.store import BatchStore
from jaxinfer.server import protocol
from jaxinfer.server.app_state import app_state
from jaxinfer.server.errors import APIError, bad_request

FILES_PATH = "/v1/files"
MAX_LIST_LIMIT = 100
MAX_METADATA_PAIRS = 16  # as OpenAI

batch_routes = Blueprint("batches", __name__)


def _store() -> BatchStore:
    return app_state().batch_store


def _json(body: dict) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), mimetype="application/json")


def _not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id!r}", param="id", code="not_found")


@batch_routes.post(FILES_PATH)
def upload_file() -> Response:
    request.max_content_length = app_state().max_file_bytes  # this path only: read before the form is
    purpose = request.form.get("purpose")
    if purpose != "batch":
        raise bad_request(f"'purpose' must be \"batch\", got {purpose!r}", param="purpose")
    upload = request.files.get("file")
    if upload is None:
        raise bad_request("a multipart 'file' part is required", param="file")
    content = upload.read()
    record = FileRecord(new_id("file"), upload.filename or "upload.jsonl", purpose, len(content), now_s())
    _store().add_file(record, content)
    return _json(record.to_openai())


@batch_routes.get(f"{FILES_PATH}/<file_id>")
def get_file(file_id: str) -> Response:
    record = _store().get_file(file_id)
    if record is None:
        raise _not_found("File", file_id)
    return _json(record.to_openai())


@batch_routes.get(f"{FILES_PATH}/<file_id>/content")
def file_content(file_id: str) -> Response:
    content = _store().read_file(file_id)
    if content is None:
        raise _not_found("File", file_id)
    return Response(content, mimetype="application/jsonl")


@batch_routes.post("/v1/batches")
def create_batch() -> Response:
    body = protocol.parse_json_body(request.get_data(cache=False))
    input_file_id = protocol.field(body, "input_file_id", "str", nullable=False)
    endpoint = protocol.field(body, "endpoint", "str", nullable=False)
    window = protocol.field(body, "completion_window", "str", nullable=False)
    if input_file_id is None:
        raise bad_request("'input_file_id' is required", param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
    if window not in COMPLETION_WINDOW_S:
        raise bad_request(f"'completion_window' must be one of {', '.join(COMPLETION_WINDOW_S)}, got {window!r}",
                          param="completion_window")
    metadata = _metadata(body.get("metadata"))
    content = _store().read_file(input_file_id)
    if content is None:
        raise bad_request(f"no file {input_file_id!r}", param="input_file_id")
    # The window is "24h" for clients; a server started with a shorter one (tests, debugging) enforces that.
    window_s = app_state().batch_window_s or COMPLETION_WINDOW_S[window]
    batch = BatchRecord(new_id("batch"), endpoint, input_file_id, window, now_s(), metadata,
                        expires_at=math.ceil(time.time() + window_s))
    try:
        lines = parse_input_file(batch.id, content, endpoint)
    except InputFileError as e:
        raise bad_request(f"input file {input_file_id!r}: {e}", param=e.param) from None
    _store().add_batch(batch, lines)
    metrics = app_state().metrics
    if metrics is not None and batch.failed:
        metrics.batch_lines_failed.inc(batch.failed)
    return _json(batch.to_openai())


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise bad_request(f"'metadata' must map at most {MAX_METADATA_PAIRS} strings to strings", param="metadata")
    return value


@batch_routes.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    batch = _store().get_batch(batch_id)
    if batch is None:
        raise _not_found("Batch", batch_id)
    return _json(batch.to_openai())


@batch_routes.get("/v1/batches")
def list_batches() -> Response:
    limit = request.args.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise bad_request(f"'limit' must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    # One more than asked says whether there is a next page.
    batches = _store().list_batches(int(limit) + 1, request.args.get("after"))
    page = batches[: int(limit)]
    return _json({"object": "list", "data": [b.to_openai() for b in page],
                  "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                  "has_more": len(batches) > len(page)})


@batch_routes.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    batch = _store().cancel_batch(batch_id)
    if batch is None:
        raise _not_found("Batch", batch_id)
    return _json(batch.to_openai())
