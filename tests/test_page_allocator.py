"""PageAllocator: refcounts, prefix sharing by chained hash, LRU eviction, all-or-nothing allocation."""

import pytest

from jaxinfer.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence

PAGE_SIZE = 4


def make_seq(seq_id, tokens, request_id=None):
    return Sequence(seq_id, request_id or f"r{seq_id}", list(tokens), arrival_time=0.0)


def compute(allocator, seq, num_tokens=None):
    """What a step does for the allocator: the K/V of the tokens exist, then register."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    assert allocator.allocate_slots(seq, num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    allocator.register_computed(seq)


def admit(allocator, seq):
    num_cached = allocator.num_cached_prefix_tokens(seq)
    return allocator.allocate_prompt(seq, seq.num_tokens - num_cached)


def check_allocator_invariants(allocator, live_seqs):
    """Refcounts match the page tables, and each page is exactly one of: scratch, used, free, cached-free."""
    refs = allocator._ref_counts
    free = list(allocator._free_pages)
    cached_free = list(allocator._cached_free_pages)
    assert all(ref >= 0 for ref in refs)
    assert refs[SCRATCH_PAGE] == 0 and SCRATCH_PAGE not in free and SCRATCH_PAGE not in cached_free
    assert len(set(free)) == len(free) and not set(free) & set(cached_free)
    expected = [0] * allocator.num_pages
    for seq in live_seqs:
        assert len(set(seq.page_table)) == len(seq.page_table), seq
        assert allocator.num_pages_for(seq.num_computed_tokens) <= len(seq.page_table), seq
        assert seq.num_registered_pages <= seq.num_computed_tokens // allocator.page_size
        for page in seq.page_table:
            expected[page] += 1
    assert refs == expected
    idle = {page for page in range(1, allocator.num_pages) if refs[page] == 0}
    assert idle == set(free) | set(cached_free)
    assert all(page in allocator._page_hash for page in cached_free)
    assert all(allocator._hash_to_page[h] == page for page, h in allocator._page_hash.items())
    assert len(allocator._hash_to_page) == len(allocator._page_hash) == len(allocator._page_tokens)
    assert allocator.num_free_pages + allocator.num_used_pages == allocator.num_usable_pages


def test_allocate_and_free_return_every_page():
    allocator = PageAllocator(8, PAGE_SIZE, "m")
    seq = make_seq(0, range(1, 11))  # 10 tokens: 3 pages
    assert admit(allocator, seq)
    assert len(seq.page_table) == 3 and SCRATCH_PAGE not in seq.page_table
    assert allocator.num_used_pages == 3 and allocator.usage == pytest.approx(3 / 7)
    check_allocator_invariants(allocator, [seq])
    allocator.free(seq)
    assert seq.page_table == [] and seq.num_computed_tokens == 0
    assert allocator.num_used_pages == 0 and allocator.num_free_pages == 7
    check_allocator_invariants(allocator, [])


def test_scratch_page_is_never_allocated():
    allocator = PageAllocator(5, PAGE_SIZE, "m")
    seq = make_seq(0, range(1, 17))
    assert admit(allocator, seq)
    assert sorted(seq.page_table) == [1, 2, 3, 4]
    assert not allocator.allocate_slots(make_seq(1, [1]), 1)


def test_shared_system_prompt_is_computed_once():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    system = list(range(100, 108))  # two full pages
    a = make_seq(0, system + [1, 2, 3])
    assert admit(allocator, a) and a.num_cached_tokens == 0
    compute(allocator, a)
    b = make_seq(1, system + [7, 8])
    assert admit(allocator, b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.page_table[:2] == a.page_table[:2] and b.page_table[2] not in a.page_table
    assert allocator._ref_counts[a.page_table[0]] == 2
    assert allocator.prefix_cache_queries == 11 + 10 and allocator.prefix_cache_hits == 8
    check_allocator_invariants(allocator, [a, b])
    allocator.free(a)
    assert allocator._ref_counts[b.page_table[0]] == 1
    allocator.free(b)
    check_allocator_invariants(allocator, [])
    assert allocator.num_used_pages == 0 and allocator.num_cached_pages == 2


def test_no_hit_before_the_page_is_computed_and_registered():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    tokens = list(range(1, 13))
    a = make_seq(0, tokens)
    assert admit(allocator, a)
    assert allocator.num_cached_prefix_tokens(make_seq(1, tokens)) == 0  # allocated, not computed
    a.num_computed_tokens = 12
    assert allocator.num_cached_prefix_tokens(make_seq(1, tokens)) == 0  # computed, not registered
    a.num_computed_tokens = 5
    allocator.register_computed(a)  # only the first page is full and computed
    assert allocator.num_cached_prefix_tokens(make_seq(1, tokens)) == 4


def test_last_token_is_always_computed():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    tokens = list(range(1, 9))  # exactly two full pages
    a = make_seq(0, tokens)
    assert admit(allocator, a)
    compute(allocator, a)
    assert allocator.num_cached_pages == 2
    b = make_seq(1, tokens)
    assert admit(allocator, b)
    assert b.num_cached_tokens == 4 and len(b.page_table) == 2


def test_hash_chain_separates_equal_pages_after_different_prefixes():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(allocator, a)
    compute(allocator, a)
    b = make_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert allocator.num_cached_prefix_tokens(b) == 0
    assert b.page_hashes[0] != a.page_hashes[0]
    assert allocator._page_hash_at(b, 1) != a.page_hashes[1]


def test_model_identity_separates_caches():
    tokens = list(range(1, 10))
    hashes = []
    for identity in ("llama-3.1-8b:bf16", "qwen3-0.6b:bf16"):
        allocator = PageAllocator(16, PAGE_SIZE, identity)
        seq = make_seq(0, tokens)
        assert admit(allocator, seq)
        compute(allocator, seq)
        hashes.append(seq.page_hashes[0])
    assert hashes[0] != hashes[1]


def test_stored_tokens_are_compared_on_a_hit():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    a = make_seq(0, range(1, 10))
    assert admit(allocator, a)
    compute(allocator, a)
    # Simulate a hash collision: the registered page claims other tokens.
    allocator._page_tokens[a.page_table[0]] = (0, 0, 0, 0)
    assert allocator.num_cached_prefix_tokens(make_seq(1, range(1, 10))) == 0


def test_lru_evicts_least_recently_freed_tail_first():
    allocator = PageAllocator(5, PAGE_SIZE, "m")  # 4 usable pages
    a = make_seq(0, range(10, 18))
    b = make_seq(1, range(20, 28))
    for seq in (a, b):
        assert admit(allocator, seq)
        compute(allocator, seq)
        allocator.free(seq)
    # LRU order now: a's tail, a's head, b's tail, b's head.
    assert allocator.num_free_pages == 4 and allocator.num_cached_pages == 4
    c = make_seq(2, [1, 2, 3])
    assert admit(allocator, c)
    assert allocator.num_cached_prefix_tokens(make_seq(3, list(range(10, 18)) + [0])) == 4
    assert allocator.num_cached_prefix_tokens(make_seq(4, list(range(20, 28)) + [0])) == 8
    d = make_seq(5, range(30, 36))  # two fresh pages: evicts a's head, then b's tail
    assert admit(allocator, d)
    assert allocator.num_cached_prefix_tokens(make_seq(6, list(range(10, 18)) + [0])) == 0
    assert allocator.num_cached_prefix_tokens(make_seq(7, list(range(20, 28)) + [0])) == 4
    check_allocator_invariants(allocator, [c, d])


def test_hit_revives_a_cached_free_page():
    allocator = PageAllocator(4, PAGE_SIZE, "m")  # 3 usable pages
    a = make_seq(0, range(1, 9))
    assert admit(allocator, a)
    compute(allocator, a)
    a_pages = list(a.page_table)
    allocator.free(a)
    b = make_seq(1, list(range(1, 9)) + [0, 0, 0, 0])  # hits 8, needs one fresh page
    assert admit(allocator, b)
    assert b.num_cached_tokens == 8 and b.page_table[:2] == a_pages
    assert allocator.num_free_pages == 0
    check_allocator_invariants(allocator, [b])


def test_placeholder_pages_are_not_hashed_until_filled():
    allocator = PageAllocator(16, PAGE_SIZE, "m")
    a = make_seq(0, [1, 2, 3, 4, 5, 6])
    assert admit(allocator, a)
    a.append_token(7)
    a.append_token(PLACEHOLDER_TOKEN)  # page 1 is [5, 6, 7, ?]
    compute(allocator, a)  # the device computed the placeholder's K/V with the real token
    assert a.num_registered_pages == 1 and allocator.num_cached_pages == 1
    probe = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 42, 0])
    assert allocator.num_cached_prefix_tokens(probe) == 4
    a.set_token(7, 42)
    allocator.register_computed(a)
    assert a.num_registered_pages == 2
    assert allocator.num_cached_prefix_tokens(make_seq(2, [1, 2, 3, 4, 5, 6, 7, 42, 0])) == 8


def test_exhaustion_returns_false_without_side_effects():
    allocator = PageAllocator(4, PAGE_SIZE, "m")  # 3 usable pages
    a = make_seq(0, range(1, 9))
    assert admit(allocator, a)
    compute(allocator, a)
    allocator.free(a)
    holder = make_seq(1, [50, 51, 52])
    assert admit(allocator, holder)  # takes the one never-cached page
    # Hits a's two cached pages but needs two more: only the revived ones would remain.
    b = make_seq(2, list(range(1, 9)) + [0] * 8)
    before = (list(allocator._ref_counts), list(allocator._cached_free_pages), allocator.prefix_cache_queries)
    assert not allocator.allocate_prompt(b, 8)
    after = (list(allocator._ref_counts), list(allocator._cached_free_pages), allocator.prefix_cache_queries)
    assert before == after and b.page_table == [] and b.num_computed_tokens == 0
    assert not allocator.allocate_slots(holder, 20)
    assert len(holder.page_table) == 1
    check_allocator_invariants(allocator, [holder])


def test_allocate_slots_grows_incrementally():
    allocator = PageAllocator(8, PAGE_SIZE, "m")
    seq = make_seq(0, range(1, 15))
    assert allocator.allocate_prompt(seq, 3)  # chunked prefill: the first chunk only
    assert len(seq.page_table) == 1
    seq.num_computed_tokens = 3
    assert allocator.allocate_slots(seq, 1) and len(seq.page_table) == 1
    assert allocator.allocate_slots(seq, 6) and len(seq.page_table) == 3


def test_reset_and_disabled_prefix_cache():
    allocator = PageAllocator(8, PAGE_SIZE, "m")
    a = make_seq(0, range(1, 10))
    assert admit(allocator, a)
    compute(allocator, a)
    allocator.free(a)
    allocator.reset_prefix_cache()
    assert allocator.num_cached_pages == 0 and allocator.num_free_pages == 7
    assert allocator.num_cached_prefix_tokens(make_seq(1, range(1, 10))) == 0
    check_allocator_invariants(allocator, [])
    disabled = PageAllocator(8, PAGE_SIZE, "m", enable_prefix_caching=False)
    for seq_id in (2, 3):
        seq = make_seq(seq_id, range(1, 10))
        assert admit(disabled, seq) and seq.num_cached_tokens == 0
        compute(disabled, seq)
    assert disabled.num_cached_pages == 0 and disabled.prefix_cache_queries == 0
