"""OpenAI's Batch API for the server: uploaded JSONL files of requests, run in the background, durably.

Modules: ``records`` (files, batches, lines and their OpenAI shapes), ``result_lines`` (input
lines in, output and error lines out), ``store`` (the :class:`BatchStore` interface) with
``sqlite_store`` (the default) and ``redis_store`` (several servers, one queue). Nothing here
knows HTTP or the engine: the server's side is :mod:`jaxinfer.server.batch_routes` (the routes),
:mod:`jaxinfer.server.batch_runner` (the background thread that runs lines at low priority) and
:mod:`jaxinfer.server.batch_line_requests` (a line as engine requests); see the Batch API section
of docs/SERVER.md.
"""

from __future__ import annotations

import pathlib

from jaxinfer.batch_api.store import BatchStore

DEFAULT_DB_NAME = "batches.sqlite3"


def open_batch_store(db_path: str | None, redis_url: str | None, lease_s: float) -> BatchStore:
    """Redis when ``redis_url`` is given, else SQLite at ``db_path`` (default: in jaxinfer's cache directory)."""
    if redis_url:
        from jaxinfer.batch_api.redis_store import RedisBatchStore  # the redis client is an optional extra

        return RedisBatchStore(redis_url, lease_s=lease_s)
    from jaxinfer.batch_api.sqlite_store import SQLiteBatchStore
    from jaxinfer.model_registry import default_cache_dir

    return SQLiteBatchStore(pathlib.Path(db_path) if db_path else default_cache_dir() / DEFAULT_DB_NAME, lease_s)
