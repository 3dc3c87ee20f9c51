"""The WSGI server: waitress, configured for streaming, disconnects and OpenAI-shaped errors.

One process (the model is loaded once), a thread per in-flight HTTP request (``threads``: enough
for every running and waiting request, so the admission queue, not waitress's backlog, decides
who waits), ``channel_request_lookahead`` so a closed socket is noticed while a handler waits on
the engine, and waitress's default ``send_bytes=1`` so every SSE chunk is written to the socket
as soon as the handler yields it.

waitress answers some requests itself, before the app is called: a body past
``max_request_body_size`` (checked from Content-Length before any of the body is read, or by
counting a chunked body as it arrives), headers past its limit, malformed HTTP. Its answer is a
plain-text page; :class:`JSONErrorTask` writes OpenAI's JSON error shape instead, so every
oversized body, of any size, gets a JSON 413 and the connection is closed without reading the rest.
A few paths (file uploads) have a larger limit of their own (:class:`PathLimitParser`).
"""

from __future__ import annotations

import copy
import errno
import json

from waitress import create_server
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.task import ErrorTask
from waitress.utilities import RequestEntityTooLarge

from jaxinfer.server.errors import APIError, body_too_large


class JSONErrorTask(ErrorTask):
    """waitress's answer to a request it refused, in OpenAI's shape (always closes the connection)."""

    def execute(self):
        error = self.request.error  # a waitress.utilities.Error: code, reason, body
        if isinstance(error, RequestEntityTooLarge):
            # waitress refuses a body of max_request_body_size bytes or more (this request's path's).
            api_error = body_too_large(self.request.adj.max_request_body_size - 1)
        else:
            api_error = APIError(error.code, f"{error.reason}: {error.body}",
                                 code=error.reason.lower().replace(" ", "_"))
        body = json.dumps(api_error.body()).encode()
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class PathLimitParser(HTTPRequestParser):
    """waitress's request parser, with a body limit per path (``path_body_limits``, set per server).

    waitress reads ``adj.max_request_body_size`` once the headers are parsed (against
    Content-Length) and as a chunked body arrives, so a request whose path has its own limit gets
    its own copy of the adjustments with that limit, before any of its body is read.
    """

    path_body_limits: dict[str, int] = {}

    def parse_header(self, header_plus):
        super().parse_header(header_plus)
        limit = self.path_body_limits.get(self.path)
        if limit is not None:
            self.adj = copy.copy(self.adj)
            self.adj.max_request_body_size = limit + 1


class JSONErrorChannel(HTTPChannel):
    error_task_class = JSONErrorTask


def create_waitress_server(app, host: str, port: int, threads: int, max_body_bytes: int,
                           path_body_limits: dict[str, int] | None = None):
    """A waitress server for ``app`` on ``host:port`` (port 0: a free one), not yet running;
    ``path_body_limits`` maps a path to its own body limit in place of ``max_body_bytes``."""
    server = create_server(
        app, host=host, port=port, threads=threads,
        connection_limit=threads + 64,
        channel_request_lookahead=1,  # keep reading the socket during a request: notices disconnects
        # waitress refuses bodies of this size or more, so exactly those past max_body_bytes; a
        # chunked body counts its chunk framing too.
        max_request_body_size=max_body_bytes + 1,
        outbuf_overflow=1 << 20, clear_untrusted_proxy_headers=True, ident="jaxinfer",
    )
    # create_server takes no channel class; one listening socket gives one TcpWSGIServer, whose
    # accept makes each connection's channel from this attribute.
    # Classes made per server, so each server's per-path limits are its own.
    parser = type("ServerPathLimitParser", (PathLimitParser,), {"path_body_limits": dict(path_body_limits or {})})
    server.channel_class = type("ServerJSONErrorChannel", (JSONErrorChannel,), {"parser_class": parser})
    return server


def serve_forever(server) -> None:
    """waitress's loop, for a thread: closing the server from another thread ends it quietly."""
    try:
        server.run()
    except ValueError:  # select() on a socket whose fd server.close() already released
        pass
    except OSError as e:
        if e.errno != errno.EBADF:
            raise
