"""APIError and OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``.

Messages are written for the client: they name the field and the limit, and never carry a
stack trace or a file path (those go to the server log).
"""

from __future__ import annotations

import json
import math

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def sse_event(self) -> str:
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_error() -> APIError:
    return APIError(500, "the engine failed while running this request; see the server log", code="engine_error")


def internal_error() -> APIError:
    """A bug in this server (the log has the traceback; the client never does)."""
    return APIError(500, "internal server error; see the server log", code="internal_error")


def body_too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes",
                    code="request_entity_too_large")
