"""Batch files as JSONL: the input file's lines in, the output and error files' lines out.

An input line is ``{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}``.
A line that cannot run (bad JSON, no or a repeated ``custom_id``, another method or URL, a body
that is not an object) does not stop the batch: it gets an error-file line at once, naming the
field. Only a file that is not JSONL at all (not UTF-8, empty, no line a JSON object) rejects the
batch (:class:`InputFileError`).

Result lines have OpenAI's shape, ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``; their ids derive from the batch id and line number, so a line run again after
a restart gets the same ids.
"""

from __future__ import annotations

import hashlib
import json

from jaxinfer.batch_api.records import BATCH_EXPIRED_MESSAGE, InputLine

MAX_LINES = 50_000  # as OpenAI


class InputFileError(ValueError):
    """The input file as a whole cannot be a batch (HTTP 400 on ``param``)."""

    def __init__(self, message: str, param: str = "input_file_id"):
        super().__init__(message)
        self.param = param


def line_ids(batch_id: str, index: int) -> tuple[str, str]:
    """The result line's ``id`` and its response's ``request_id``, the same on every run."""
    digest = hashlib.sha256(f"{batch_id}:{index}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}", f"req_{digest[32:64]}"


def response_line(batch_id: str, index: int, custom_id: str | None, status_code: int, body: dict) -> dict:
    """A line answered by the server: status 200 goes to the output file, any other to the error file."""
    line_id, request_id = line_ids(batch_id, index)
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def refusal_line(batch_id: str, index: int, custom_id: str | None, message: str, param: str, code: str) -> dict:
    """A line that never became a request (error file): ``error`` says why, ``response`` is null."""
    line_id, _ = line_ids(batch_id, index)
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "param": param}}


def expired_line(batch_id: str, index: int, custom_id: str | None) -> dict:
    """A line its batch's completion window closed on before it ran (error file, OpenAI's ``batch_expired``)."""
    line_id, _ = line_ids(batch_id, index)
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": "batch_expired", "message": BATCH_EXPIRED_MESSAGE, "param": None}}


def is_error(result: dict) -> bool:
    return result["response"] is None or result["response"]["status_code"] != 200


def parse_input_file(batch_id: str, content: bytes, endpoint: str) -> list[InputLine]:
    """Every non-blank line of ``content``, each with its body or its refusal; see the module docstring."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError("the input file is not UTF-8 text (JSONL expected)") from None
    numbered = [(i, raw) for i, raw in enumerate(text.splitlines()) if raw.strip()]
    if not numbered:
        raise InputFileError("the input file is empty (JSONL expected: one request per line)")
    if len(numbered) > MAX_LINES:
        raise InputFileError(f"the input file has {len(numbered)} requests; a batch holds at most {MAX_LINES}")
    lines, seen = [], set()
    for index, raw in numbered:
        lines.append(_parse_line(batch_id, index, raw, endpoint, seen))
    if all(_is_bad_json(line) for line in lines):
        raise InputFileError("no line of the input file is a JSON object (JSONL expected: one request per line)")
    return lines


def _is_bad_json(line: InputLine) -> bool:
    return line.result is not None and line.result["error"]["code"] == "invalid_json_line"


def _parse_line(batch_id: str, index: int, raw: str, endpoint: str, seen: set[str]) -> InputLine:
    def refuse(custom_id, message, param, code="invalid_request"):
        result = refusal_line(batch_id, index, custom_id, f"line {index + 1}: {message}", param, code)
        return InputLine(index, custom_id, None, result)

    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):
        return refuse(None, "not valid JSON", "line", "invalid_json_line")
    if not isinstance(request, dict):
        return refuse(None, "not a JSON object", "line", "invalid_json_line")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return refuse(None, "'custom_id' must be a non-empty string", "custom_id", "missing_custom_id")
    if custom_id in seen:
        return refuse(custom_id, f"'custom_id' {custom_id!r} repeats an earlier line's", "custom_id",
                      "duplicate_custom_id")
    seen.add(custom_id)
    if request.get("method") != "POST":
        return refuse(custom_id, "'method' must be \"POST\"", "method", "invalid_method")
    if request.get("url") != endpoint:
        return refuse(custom_id, f"'url' must be this batch's endpoint {endpoint!r}, got {request.get('url')!r}",
                      "url", "invalid_url")
    if not isinstance(request.get("body"), dict):
        return refuse(custom_id, "'body' must be a JSON object", "body")
    return InputLine(index, custom_id, request["body"])


def result_files(results: list[dict]) -> tuple[bytes, bytes]:
    """The output file (status-200 lines) and the error file (the rest), in input order as given."""
    output = [json.dumps(r, ensure_ascii=False) for r in results if not is_error(r)]
    errors = [json.dumps(r, ensure_ascii=False) for r in results if is_error(r)]
    return (("\n".join(output) + "\n").encode() if output else b"",
            ("\n".join(errors) + "\n").encode() if errors else b"")
