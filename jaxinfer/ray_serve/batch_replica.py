"""BatchRunnerReplica: the Batch API's queue and runner under Ray Serve, as one deployment.

The ingress serves ``/v1/files`` and ``/v1/batches`` (the routes of ``server.py``); the lines
run here, in a :class:`~jaxinfer.server.batch_runner.BatchRunner` whose engine client is a
:class:`~jaxinfer.ray_serve.remote_client.RemoteEngineClient` over the engine deployment's
handle, so batch lines reach the engine replicas through the same request router as interactive
calls, and only while the replicas' queues are short (the runner's low-priority rule, scaled by
the number of replicas).

Where the queue lives (:class:`~jaxinfer.ray_serve.config.BatchStoreOptions`):

- **SQLite** (the default): this deployment has exactly one replica, which owns the file; the
  ingress reaches the store through this replica (:class:`RemoteBatchStore`). One node holds
  the file, so the batch queue does not survive the loss of that node's disk.
- **Redis** (``--batch-redis``): the ingress replicas open the store themselves, and this
  deployment may have several replicas (``--batch-runners``), each a consumer of the same
  stream; so may other Ray clusters or ``jaxinfer serve`` instances on the same Redis. This is
  the multi-instance answer: a runner that dies leaves its lines to the others after the lease.
"""

from __future__ import annotations

import logging

from jaxinfer.batch_api.records import BatchRecord, FileRecord, InputLine
from jaxinfer.ray_serve.config import BatchStoreOptions
from jaxinfer.ray_serve.remote_client import RemoteEngineClient
from jaxinfer.server.batch_runner import BatchRunner, BatchRunnerConfig
from jaxinfer.server.metrics import ServerMetrics

logger = logging.getLogger("jaxinfer.ray_serve")

STORE_CALL_TIMEOUT_S = 60.0
BATCH_METRIC_PREFIX = "jaxinfer:batch_"  # the families this replica's /metrics share adds to the ingress's


class BatchRunnerReplica:
    """One batch runner (and, with SQLite, the store's owner); see the module docstring."""

    async def __init__(self, engine_handle, store_options: BatchStoreOptions, served_model_name: str,
                       runner_config: BatchRunnerConfig, retry_after_s: float):
        description = await engine_handle.describe.remote()  # waits for an engine replica to be compiled
        self.store = store_options.open()
        self.metrics = ServerMetrics(served_model_name, description["max_model_len"])
        client = RemoteEngineClient(engine_handle, description["tokenizer"], description["max_model_len"],
                                    max_streams=runner_config.max_lines_in_flight, retry_after_s=retry_after_s)
        self.runner = BatchRunner(self.store, client, served_model_name, self.metrics, runner_config)
        self.runner.start()

    # The store, for the ingress's RemoteBatchStore (SQLite: the one process that opens the file).
    def add_file(self, record: FileRecord, content: bytes) -> None:
        self.store.add_file(record, content)

    def get_file(self, file_id: str) -> FileRecord | None:
        return self.store.get_file(file_id)

    def read_file(self, file_id: str) -> bytes | None:
        return self.store.read_file(file_id)

    def add_batch(self, batch: BatchRecord, lines: list[InputLine]) -> BatchRecord:
        self.store.add_batch(batch, lines)
        return batch  # with the counts add_batch set: the caller's copy did not cross back

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        return self.store.get_batch(batch_id)

    def list_batches(self, limit: int, after: str | None) -> list[BatchRecord]:
        return self.store.list_batches(limit, after)

    def cancel_batch(self, batch_id: str) -> BatchRecord | None:
        return self.store.cancel_batch(batch_id)

    def metric_families(self) -> list:
        """The batch families of this runner's metrics (pending, completed and failed lines)."""
        return [f for f in self.metrics.registry.collect() if f.name.startswith(BATCH_METRIC_PREFIX)]

    def __del__(self):
        # Serve calls it when the replica stops: lines in flight stay unrecorded and run again later.
        self.runner.stop()
        self.store.close()


class RemoteBatchStore:
    """The routes' side of a :class:`~jaxinfer.batch_api.store.BatchStore` held by the batch-runner
    replica (SQLite under Ray): each call crosses to it through its handle. The runner's side
    (claims, results, finalizing) stays in that replica."""

    def __init__(self, batch_handle):
        self._handle = batch_handle

    def _call(self, method: str, *args):
        return getattr(self._handle, method).remote(*args).result(timeout_s=STORE_CALL_TIMEOUT_S)

    def add_file(self, record: FileRecord, content: bytes) -> None:
        self._call("add_file", record, content)

    def get_file(self, file_id: str) -> FileRecord | None:
        return self._call("get_file", file_id)

    def read_file(self, file_id: str) -> bytes | None:
        return self._call("read_file", file_id)

    def add_batch(self, batch: BatchRecord, lines: list[InputLine]) -> None:
        stored = self._call("add_batch", batch, lines)
        batch.total, batch.failed = stored.total, stored.failed  # as a local store sets them

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        return self._call("get_batch", batch_id)

    def list_batches(self, limit: int, after: str | None) -> list[BatchRecord]:
        return self._call("list_batches", limit, after)

    def cancel_batch(self, batch_id: str) -> BatchRecord | None:
        return self._call("cancel_batch", batch_id)

    def close(self) -> None:
        """Nothing to close here: the batch-runner replica owns the store."""
