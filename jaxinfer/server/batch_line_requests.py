"""One batch line as engine requests: the same validation and response body as its HTTP endpoint.

A line's body goes through :func:`jaxinfer.server.protocol.parse_chat` or ``parse_completion``,
exactly as a ``POST`` to its URL would, so a line that fails validation carries the same 400
(naming the field) in the error file, and a line that runs carries the same JSON body the
endpoint would have answered (built by :class:`~jaxinfer.server.responses.ResponseBuilder`).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.batch_api.records import ClaimedLine
from jaxinfer.batch_api.result_lines import line_ids
from jaxinfer.engine_client import EngineRequest
from jaxinfer.server import protocol
from jaxinfer.server.errors import bad_request
from jaxinfer.server.responses import ResponseBuilder


@dataclasses.dataclass
class LineRequests:
    parsed: protocol.ParsedRequest
    requests: list[EngineRequest]  # one per prompt
    builder: ResponseBuilder


def engine_request_prefix(line: ClaimedLine) -> str:
    """Engine request ids of a line start with this: unique per engine, the same on a re-run."""
    return f"batch-{line.batch_id}-{line.index}"


def prepare_line(line: ClaimedLine, tokenizer, max_model_len: int, served_model_name: str) -> LineRequests:
    """The line's engine requests; raises the :class:`~jaxinfer.server.errors.APIError` its URL would answer."""
    is_chat = line.endpoint == "/v1/chat/completions"
    if line.body.get("stream"):
        raise bad_request("a batch request cannot stream; remove 'stream' from the body", param="stream")
    parse = protocol.parse_chat if is_chat else protocol.parse_completion
    parsed = parse(line.body, tokenizer, max_model_len, served_model_name)
    _, request_id = line_ids(line.batch_id, line.index)
    prefix = engine_request_prefix(line)
    requests = [EngineRequest(f"{prefix}-{i}", p.token_ids, params, prompt=p.text, log_id=request_id)
                for i, (p, params) in enumerate(zip(parsed.prompts, parsed.params))]
    response_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id.removeprefix('req_')}"
    return LineRequests(parsed, requests, ResponseBuilder(parsed, response_id, tokenizer))
