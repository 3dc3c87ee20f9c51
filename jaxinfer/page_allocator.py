"""PageAllocator: reference-counted KV pages with prefix sharing of full pages (host only).

The device holds ``num_pages`` pages of ``page_size`` token slots per layer; this class decides
which sequence owns which page. Page ``SCRATCH_PAGE`` (0) is never handed out: the runner pads
page tables with it and may let padded token rows write their K/V there.

Prefix sharing: once every token of a full page is known and its K/V computed, the page is
registered under a chained SHA-256 hash of (previous page's hash, model identity, the page's
token ids). A later sequence whose leading pages hash the same attaches those pages instead of
recomputing them. The chain makes a page's hash stand for the whole prefix up to it, so equal
tokens after different prefixes never match; the model identity keeps different models (or
adapters, or dtypes: whatever the engine puts in it) apart; and a hit also compares the stored
token ids, so even a hash collision cannot serve one client's cache to another.

A page with refcount 0 whose hash is registered is "free but cached": it counts as free, keeps
its K/V, and is evicted least-recently-used only when a fresh page is needed. A sequence frees
its pages last-to-first, so a prefix's tail is evicted before its head.

Registration happens after a step is launched (``register_computed``), never at admission, so
a sequence only hits pages whose K/V a previous step writes: the device runs steps in order.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence

SCRATCH_PAGE = 0  # reserved: padding target of page tables, never allocated


class PageAllocator:
    def __init__(
        self, num_pages: int, page_size: int, model_identity: str, enable_prefix_caching: bool = True
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.model_identity = model_identity
        self.enable_prefix_caching = enable_prefix_caching
        # The chain's root: the first page of every prefix hashes under it, so every hash in the
        # chain depends on the model identity.
        self._identity_hash = hashlib.sha256(b"jaxinfer-page-hash-v1\0" + model_identity.encode()).digest()
        self._ref_counts = [0] * num_pages
        self._free_pages = collections.deque(range(1, num_pages))  # refcount 0, not cached
        self._cached_free_pages: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._page_hash: dict[int, bytes] = {}
        self._page_tokens: dict[int, tuple[int, ...]] = {}
        self._hash_to_page: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages a sequence can take now: never-used plus evictable cached ones."""
        return len(self._free_pages) + len(self._cached_free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Registered pages, in use or not."""
        return len(self._page_hash)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the cache would serve if it were admitted now (no side effects on the pool)."""
        return len(self._find_cached_prefix(seq)) * self.page_size

    def num_pages_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Free pages that ``seq``, admitted now, would take to hold its first ``num_tokens`` tokens.

        As ``allocate_prompt`` counts them: a cached prefix page another sequence holds costs
        nothing, a cached page with no holder is revived out of the free pages, and the rest are
        fresh. No side effects on the pool.
        """
        cached_pages = self._find_cached_prefix(seq)
        num_revived = sum(1 for page in cached_pages if self._ref_counts[page] == 0)
        return max(self.num_pages_for(num_tokens) - len(cached_pages), 0) + num_revived

    def allocate_prompt(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Admit ``seq``: attach its longest cached prefix and fresh pages for ``num_new_tokens`` after it.

        ``num_new_tokens`` counts from the end of the cached prefix (ask
        ``num_cached_prefix_tokens`` first). All or nothing: returns False, changing nothing,
        when the pool is short.
        """
        if seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already holds pages")
        cached_pages = self._find_cached_prefix(seq)
        num_cached_tokens = len(cached_pages) * self.page_size
        if num_new_tokens < 1 or num_cached_tokens + num_new_tokens > seq.num_tokens:
            raise ValueError(
                f"num_new_tokens={num_new_tokens} after {num_cached_tokens} cached tokens does not fit "
                f"sequence {seq.seq_id} of {seq.num_tokens} tokens"
            )
        num_fresh = self.num_pages_for(num_cached_tokens + num_new_tokens) - len(cached_pages)
        num_revived = sum(1 for page in cached_pages if self._ref_counts[page] == 0)
        if num_fresh + num_revived > self.num_free_pages:
            return False
        # Revive the hits before taking fresh pages, so the eviction cannot pick them.
        for page in cached_pages:
            if self._ref_counts[page] == 0:
                del self._cached_free_pages[page]
            self._ref_counts[page] += 1
        seq.page_table = cached_pages + [self._take_fresh_page() for _ in range(num_fresh)]
        seq.num_computed_tokens = num_cached_tokens
        seq.num_cached_tokens = num_cached_tokens
        seq.num_registered_pages = len(cached_pages)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s page table to cover ``num_computed_tokens + num_new_tokens``.

        Returns False, changing nothing, when the pool is short.
        """
        num_needed = seq.num_computed_tokens + num_new_tokens
        if num_needed <= len(seq.page_table) * self.page_size:
            return True  # the common decode step: the last page has room
        num_fresh = self.num_pages_for(num_needed) - len(seq.page_table)
        if num_fresh > self.num_free_pages:
            return False
        seq.page_table.extend(self._take_fresh_page() for _ in range(num_fresh))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s pages (its K/V are gone from its point of view: ``num_computed_tokens = 0``)."""
        # Last to first: the tail of a cached prefix enters the LRU first and is evicted first.
        for page in reversed(seq.page_table):
            self._ref_counts[page] -= 1
            if self._ref_counts[page] < 0:
                raise AssertionError(f"page {page} freed more often than allocated")
            if self._ref_counts[page] == 0:
                if page in self._page_hash:
                    self._cached_free_pages[page] = None
                else:
                    self._free_pages.append(page)
        seq.page_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_pages = 0

    def free_tail(self, seq: Sequence, num_lookahead_slots: int = 0) -> int:
        """Free ``seq``'s pages wholly past its tokens (rollback of rejected drafts); returns how many.

        Such pages hold only the K/V of rejected drafts: fresh, never registered, owned by
        ``seq`` alone. ``num_computed_tokens`` must already be rolled back.
        ``num_lookahead_slots``: slots past the tokens to keep, which a step in flight may write.
        """
        num_kept = min(self.num_pages_for(seq.num_tokens + num_lookahead_slots), len(seq.page_table))
        if seq.num_computed_tokens > num_kept * self.page_size:
            raise ValueError(f"sequence {seq.seq_id} has computed tokens in the pages it would free")
        tail = seq.page_table[num_kept:]
        for page in reversed(tail):
            if self._ref_counts[page] != 1 or page in self._page_hash:
                raise AssertionError(f"page {page} past sequence {seq.seq_id}'s tokens is shared or registered")
            self._ref_counts[page] = 0
            self._free_pages.append(page)
        # A new list, not an in-place cut: the page table is only ever grown in place (Sequence.page_table).
        seq.page_table = seq.page_table[:num_kept]
        return len(tail)

    def register_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s newly completed full pages whose K/V are computed and tokens all known.

        Call after each step that computed tokens of ``seq`` (the scheduler's ``postprocess``
        does); a page skipped for a placeholder is picked up by a later call once it is filled.
        """
        if not self.enable_prefix_caching:
            return
        num_full_pages = min(seq.num_computed_tokens // self.page_size, len(seq.page_table))
        for index in range(seq.num_registered_pages, num_full_pages):
            page_hash = self._page_hash_at(seq, index)
            if page_hash is None:
                return
            page = seq.page_table[index]
            # The same prefix computed by two sequences at once: the first registration wins and
            # the other copy is freed as an ordinary page.
            if page_hash not in self._hash_to_page and page not in self._page_hash:
                self._page_hash[page] = page_hash
                self._page_tokens[page] = tuple(self._tokens_of_page(seq, index))
                self._hash_to_page[page_hash] = page
            seq.num_registered_pages = index + 1

    def reset_prefix_cache(self) -> None:
        """Forget every registered page (e.g. after new weights are loaded); pages in use stay allocated."""
        self._free_pages.extend(self._cached_free_pages)
        self._cached_free_pages.clear()
        self._page_hash.clear()
        self._page_tokens.clear()
        self._hash_to_page.clear()

    def _take_fresh_page(self) -> int:
        if self._free_pages:
            page = self._free_pages.popleft()
        else:
            page, _ = self._cached_free_pages.popitem(last=False)
            del self._hash_to_page[self._page_hash.pop(page)]
            del self._page_tokens[page]
        self._ref_counts[page] = 1
        return page

    def _find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered pages matching ``seq``'s leading full pages, leaving its last token uncached."""
        if not self.enable_prefix_caching:
            return []
        # At least one token must be computed: the last one produces the logits to sample from.
        max_pages = (seq.num_tokens - 1) // self.page_size
        pages = []
        for index in range(max_pages):
            page_hash = self._page_hash_at(seq, index)
            page = self._hash_to_page.get(page_hash) if page_hash is not None else None
            if page is None or self._page_tokens[page] != tuple(self._tokens_of_page(seq, index)):
                break
            pages.append(page)
        return pages

    def _page_hash_at(self, seq: Sequence, index: int) -> bytes | None:
        """Chained hash of ``seq``'s page ``index``; None if it is not full or holds a placeholder."""
        while len(seq.page_hashes) <= index:
            next_index = len(seq.page_hashes)
            tokens = self._tokens_of_page(seq, next_index)
            if len(tokens) < self.page_size or PLACEHOLDER_TOKEN in tokens:
                return None
            previous = seq.page_hashes[-1] if seq.page_hashes else self._identity_hash
            seq.page_hashes.append(
                hashlib.sha256(previous + self._identity_hash + array("q", tokens).tobytes()).digest()
            )
        return seq.page_hashes[index]

    def _tokens_of_page(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids[index * self.page_size : (index + 1) * self.page_size]
