"""WSGIBridge: the Flask app (a WSGI app) served as the ASGI app Ray Serve's ingress needs.

a2wsgi runs each request's WSGI call in a thread of its pool and forwards the chunks the app
yields to ASGI ``send`` as they come, so SSE streams through unchanged. Two things it does not
do, added here:

- **Disconnects.** When the HTTP client hangs up, Serve's proxy cancels the ingress's ASGI call;
  Serve's direct ingress (HAProxy into the replica's own HTTP server) sends ``http.disconnect``
  instead, which the bridge watches for once the body is read. On a cancel, a2wsgi would stop
  forwarding chunks while its WSGI thread blocks forever on a full send queue, and the engine
  request would run to its end. Here the WSGI call is shielded from that
  cancellation: it runs on, its remaining chunks are dropped, and the disconnect is reported to
  the routes through ``environ["waitress.client_disconnected"]``, the callable the completion
  routes already poll (``completion_routes._Call``), so they abort the engine requests within
  their poll interval (0.2 s) and return, freeing the thread.
- **Pool size.** A streaming request holds a thread for its whole life, so the pool must hold
  every stream in flight (``num_threads``); a2wsgi's default of 10 would queue the 11th stream.
- **No wait per chunk** (:class:`_Responder`). a2wsgi's responder makes the WSGI thread wait for
  the event loop on every chunk it writes (the headers and each SSE event): two thread switches
  before the route may go on, each a scheduling delay on a busy machine, on the path of the first
  token. Here the thread hands the chunk to the loop and goes on; it waits only while
  ``MAX_BUFFERED_CHUNKS`` chunks are not yet sent (the back-pressure of a slow client).

a2wsgi still builds the WSGI environ and reads the request body.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

from a2wsgi.wsgi import Body, build_environ

# The environ key the completion routes poll for a client that went away (waitress's name: the
# routes were written for waitress, and honouring the same key keeps them server-agnostic).
DISCONNECTED_KEY = "waitress.client_disconnected"
_SCOPE_KEY = "jaxinfer.client_gone"  # the request's threading.Event, carried in the ASGI scope
MAX_BUFFERED_CHUNKS = 16  # chunks a WSGI thread may write ahead of the client before it waits


class WSGIBridge:
    """An ASGI app serving ``wsgi_app`` from ``num_threads`` threads; see the module docstring."""

    def __init__(self, wsgi_app, num_threads: int):
        self._wsgi_app = wsgi_app
        self._threads = ThreadPoolExecutor(num_threads, thread_name_prefix="WSGI")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop: say so
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":  # websockets: not served
            await send({"type": "websocket.close", "code": 1000})
            return
        client_gone = threading.Event()
        body_read = asyncio.Event()

        async def receive_body():
            message = await receive()
            if message["type"] == "http.disconnect":
                client_gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def send_until_gone(message) -> None:
            if not client_gone.is_set():
                await send(message)

        async def watch_for_disconnect() -> None:
            await body_read.wait()  # after the body, the only message left is the disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone.set()

        responder = _Responder(asyncio.get_running_loop(), MAX_BUFFERED_CHUNKS)
        call = asyncio.ensure_future(responder.run(self._with_disconnect_flag, self._threads,
                                                   {**scope, _SCOPE_KEY: client_gone}, receive_body, send_until_gone))
        watcher = asyncio.ensure_future(watch_for_disconnect())
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            client_gone.set()  # the WSGI call runs on in the background until the route returns
            raise
        finally:
            watcher.cancel()

    def _with_disconnect_flag(self, environ, start_response):
        environ[DISCONNECTED_KEY] = environ["asgi.scope"][_SCOPE_KEY].is_set
        return self._wsgi_app(environ, start_response)


class _Responder:
    """One WSGI call, run in a pool thread, its chunks sent to ASGI ``send`` in order by a task of
    the event loop; the thread waits only while ``max_buffered`` chunks are unsent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_buffered: int):
        self._loop = loop
        self._max_buffered = max_buffered
        self._chunks: asyncio.Queue = asyncio.Queue()  # bounded by _room, not by the queue
        self._room = threading.Semaphore(max_buffered)
        self._closed = False  # the sender stopped: further chunks are dropped, never waited for
        self._exc_info = None
        self._started = False

    async def run(self, app, threads: ThreadPoolExecutor, scope, receive, send) -> None:
        environ = build_environ(scope, Body(self._loop, receive))
        sender = self._loop.create_task(self._send_all(send))
        try:
            call = contextvars.copy_context().run
            await self._loop.run_in_executor(threads, call, self._call_app, app, environ)
            # The thread's chunks were queued by callbacks scheduled before this one: the end is last.
            self._chunks.put_nowait(None)
            await sender
            if self._exc_info is not None:
                raise self._exc_info[1].with_traceback(self._exc_info[2])
        finally:
            if not sender.done():
                sender.cancel()

    def _call_app(self, app, environ) -> None:
        """In the pool thread: the WSGI call, its chunks written as they come."""
        chunks = app(environ, self._start_response)
        try:
            for chunk in chunks:
                if chunk:
                    self._write({"type": "http.response.body", "body": chunk, "more_body": True})
            self._write({"type": "http.response.body", "body": b""})
        finally:
            getattr(chunks, "close", lambda: None)()

    def _start_response(self, status: str, headers, exc_info=None):
        self._exc_info = exc_info
        if not self._started:
            self._started = True
            self._write({"type": "http.response.start", "status": int(status.split(" ", 1)[0]),
                         "headers": [(k.strip().encode("latin1").lower(), v.strip().encode("latin1"))
                                     for k, v in headers]})
        return lambda chunk: self._write({"type": "http.response.body", "body": chunk, "more_body": True})

    def _write(self, message: dict) -> None:
        """In the pool thread: queue ``message`` for the loop, waiting only for room in the buffer."""
        while not self._room.acquire(timeout=1.0):
            if self._closed:
                return
        if self._closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._chunks.put_nowait, message)
        except RuntimeError:  # the loop has closed (the replica is stopping)
            self._closed = True

    async def _send_all(self, send) -> None:
        try:
            while (message := await self._chunks.get()) is not None:
                try:
                    await send(message)
                finally:
                    self._room.release()
        finally:
            self._closed = True
            self._room.release(self._max_buffered)  # a thread waiting for room sees _closed
