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
"""

from __future__ import annotations

import asyncio
import threading

from a2wsgi import WSGIMiddleware

# The environ key the completion routes poll for a client that went away (waitress's name: the
# routes were written for waitress, and honouring the same key keeps them server-agnostic).
DISCONNECTED_KEY = "waitress.client_disconnected"
_SCOPE_KEY = "jaxinfer.client_gone"  # the request's threading.Event, carried in the ASGI scope


class WSGIBridge:
    """An ASGI app serving ``wsgi_app`` from ``num_threads`` threads; see the module docstring."""

    def __init__(self, wsgi_app, num_threads: int):
        self._wsgi_app = wsgi_app
        self._middleware = WSGIMiddleware(self._with_disconnect_flag, workers=num_threads)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._middleware(scope, receive, send)
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

        call = asyncio.ensure_future(self._middleware({**scope, _SCOPE_KEY: client_gone}, receive_body,
                                                      send_until_gone))
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
