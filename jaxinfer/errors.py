"""Typed errors an engine raises when it refuses a request.

Each carries the request field it is about and, where there is one, the limit it broke, so a
caller (the HTTP server, a Ray ingress, a notebook) maps the *type* to its own error shape and
never parses a message. All are ``ValueError``s, so code that caught ``ValueError`` still does.

    try:
        engine.add_request(request_id, token_ids, params)
    except RequestError as e:
        e.field, e.limit, e.code   # "prompt", 2048, "context_length_exceeded"
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine will not run, through the client's fault (HTTP 400).

    Attributes:
        field: the request field at fault (``"prompt"``, ``"stop_token_ids"``, ``"min_tokens"``, ...).
        limit: the limit that was broken, when there is one (a length, a bound, a count).
        code: a short machine-readable reason (OpenAI's ``error.code``).
    """

    code = "invalid_value"

    def __init__(self, message: str, *, field: str, limit: object = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.limit = limit


class PromptTooLongError(RequestError):
    """A prompt (with the room it needs for output) does not fit in ``max_model_len``."""

    code = "context_length_exceeded"


class RequestIdInUseError(RequestError):
    """A request id that an unfinished request already holds."""

    code = "duplicate_request_id"
