"""PrefixAwareRouter: send a prompt to the engine replica that already holds its prefix's KV pages.

Each replica's engine caches full KV pages by their chained hash (``PageAllocator``), so a
prompt whose leading pages another request already computed *on the same replica* skips their
prefill. Serve's default router (power of two choices) ignores that and spreads a shared
system prompt over every replica, each computing it once more.

This router (a Ray Serve ``RequestRouter``, run in the caller: the ingress's handle) mirrors
the engine's pages: it cuts the first request's prompt token ids of each call into pages of
``page_size`` tokens, chains their hashes (a hash stands for its whole prefix, as in the
engine), and remembers, for each chain hash, the replica it last sent that prefix to (at most
``max_tracked_pages``, least recently used forgotten first). For a new call:

1. the replica owning the longest remembered prefix of the prompt is preferred, unless it is
   *busy*: its ongoing requests exceed the least loaded candidate's by more than
   ``max_imbalance`` (or it is full), when a cache hit would cost more in queueing than it saves;
2. otherwise, or with no remembered prefix, the candidates go to Serve as one rank, and Serve
   picks the least loaded (by its queue-length cache, probing replicas it has no entry for).

Prompts shorter than one page have no key and are balanced by load.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from jaxinfer.engine_client import EngineRequest


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, page_size: int = 32, max_prefix_pages: int = 64, max_imbalance: int = 8,
                         max_tracked_pages: int = 1 << 16) -> None:
        """Called by Serve with ``request_router_kwargs``; ``page_size`` should be the engine's."""
        self.page_size = page_size
        self.max_prefix_pages = max_prefix_pages
        self.max_imbalance = max_imbalance
        self.max_tracked_pages = max_tracked_pages
        self._owner_of_page: OrderedDict[int, ReplicaID] = OrderedDict()  # chain hash -> replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # All candidates full: let Serve back off between rounds instead of spinning.
        pending_request.routing_context.should_backoff = True
        owner = self._prefix_owner(self.page_hashes(pending_request), candidate_replicas)
        if owner is None or self._is_busy(owner, candidate_replicas):
            return [candidate_replicas]
        return [[owner], [r for r in candidate_replicas if r is not owner]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for page_hash in self.page_hashes(pending_request):
            self._owner_of_page[page_hash] = replica_id
            self._owner_of_page.move_to_end(page_hash)
        while len(self._owner_of_page) > self.max_tracked_pages:
            self._owner_of_page.popitem(last=False)

    def page_hashes(self, pending_request: PendingRequest) -> list[int]:
        """The chained hashes of the call's first prompt's full pages (up to ``max_prefix_pages``)."""
        requests = pending_request.args[0] if pending_request.args else None
        if not (isinstance(requests, list) and requests and isinstance(requests[0], EngineRequest)):
            return []  # not a generate/score call (stats, describe): no prefix
        token_ids = requests[0].prompt_token_ids
        num_pages = min(len(token_ids) // self.page_size, self.max_prefix_pages)
        hashes, previous = [], 0
        for i in range(num_pages):
            previous = hash((previous, tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])))
            hashes.append(previous)
        return hashes

    def _prefix_owner(self, page_hashes: list[int], candidates: list[RunningReplica]) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        for page_hash in reversed(page_hashes):  # the longest prefix first
            owner = by_id.get(self._owner_of_page.get(page_hash))
            if owner is not None:
                return owner
        return None

    def _is_busy(self, owner: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        owner_load = cache.get(owner.replica_id)
        if owner_load is None:
            return False  # unknown: Serve probes it when it tries the owner
        if owner_load >= owner.max_ongoing_requests:
            return True
        least_load = min((cache.get(r.replica_id) or 0) for r in candidates)
        return owner_load - least_load > self.max_imbalance
