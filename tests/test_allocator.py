"""Page allocator: exact page ids, eviction order, refcounts, and the invariant after every operation."""

import random

import pytest

from jaxserve.kv.allocator import OutOfPagesError, PageAllocator, chain_hash, page_hashes


def checked(alloc: PageAllocator) -> PageAllocator:
    alloc.check_invariants()
    return alloc


def test_fresh_pages_come_in_order_and_skip_the_null_page():
    alloc = PageAllocator(num_pages=6, page_size=4)
    assert alloc.allocate(2) == [1, 2]
    assert alloc.allocate(3) == [3, 4, 5]
    assert alloc.num_free_pages == 0
    checked(alloc)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)


def test_freed_pages_are_reused_fifo():
    alloc = PageAllocator(num_pages=6, page_size=4, enable_prefix_caching=False)
    a = alloc.allocate(3)
    alloc.free(a)  # freed in reverse: 3, 2, 1 join the free list after 4, 5
    checked(alloc)
    assert alloc.allocate(5) == [4, 5, 3, 2, 1]


def test_shared_pages_need_every_owner_to_free_them():
    alloc = PageAllocator(num_pages=4, page_size=4, enable_prefix_caching=False)
    pages = alloc.allocate(2)
    alloc.share(pages)
    assert [alloc.refcount(p) for p in pages] == [2, 2]
    alloc.free(pages)
    assert alloc.num_free_pages == 1
    alloc.free(pages)
    assert alloc.num_free_pages == 3
    checked(alloc)
    with pytest.raises(ValueError):
        alloc.free(pages)


def test_page_hashes_chain_on_the_prefix():
    hashes = page_hashes(list(range(10)), page_size=4)
    assert len(hashes) == 2  # the last 2 tokens do not fill a page
    assert hashes[0] == chain_hash(b"", [0, 1, 2, 3])
    assert hashes[1] == chain_hash(hashes[0], [4, 5, 6, 7])
    assert page_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # same page tokens, different prefix
    assert page_hashes(list(range(12)), 4, known=hashes) == page_hashes(list(range(12)), 4)


def test_prefix_hit_revives_a_cached_page_and_counts_stats():
    alloc = PageAllocator(num_pages=8, page_size=4)
    tokens = list(range(12))
    hashes = page_hashes(tokens, 4)
    pages = alloc.allocate(3)
    alloc.register_full_pages(pages, hashes)
    alloc.free(pages)
    assert alloc.num_free_pages == 7 and alloc.num_used_pages == 0
    checked(alloc)
    hit = alloc.lookup_prefix(hashes, max_pages=2)
    assert hit == pages[:2]
    assert [alloc.refcount(p) for p in hit] == [1, 1]
    assert alloc.stats.queries == 8 and alloc.stats.hits == 8
    checked(alloc)
    other = page_hashes([99] + tokens[1:], 4)
    assert alloc.lookup_prefix(other, max_pages=3) == []
    assert alloc.stats.hits == 8 and alloc.stats.queries == 20


def test_eviction_takes_free_pages_first_then_the_oldest_cached_tail_first():
    alloc = PageAllocator(num_pages=6, page_size=2)
    seq = alloc.allocate(3)  # pages 1, 2, 3
    alloc.register_full_pages(seq, page_hashes([1, 2, 3, 4, 5, 6], 2))
    alloc.free(seq)  # cached in order 3, 2, 1 (tail first)
    assert alloc.allocate(2) == [4, 5]  # free pages before evicting anything
    assert alloc.allocate(1) == [3]  # then the tail page of the cached sequence
    checked(alloc)
    # page 3 lost its hash, so the prefix lookup stops after pages 1, 2
    assert alloc.lookup_prefix(page_hashes([1, 2, 3, 4, 5, 6], 2), max_pages=3) == [1, 2]
    checked(alloc)


def test_duplicate_content_keeps_the_first_page():
    alloc = PageAllocator(num_pages=4, page_size=2)
    h = page_hashes([7, 7], 2)
    a, b = alloc.allocate(1), alloc.allocate(1)
    alloc.register_full_pages(a, h)
    alloc.register_full_pages(b, h)
    alloc.free(b)
    assert alloc.num_free_pages == 2  # b was never cached: plain free
    assert alloc.lookup_prefix(h, 1) == a
    checked(alloc)


def test_disabled_prefix_cache_never_hits():
    alloc = PageAllocator(num_pages=4, page_size=2, enable_prefix_caching=False)
    h = page_hashes([1, 2], 2)
    pages = alloc.allocate(1)
    alloc.register_full_pages(pages, h)
    alloc.free(pages)
    assert alloc.lookup_prefix(h, 1) == []
    checked(alloc)


def test_reset_prefix_cache_frees_cached_pages():
    alloc = PageAllocator(num_pages=4, page_size=2)
    pages = alloc.allocate(2)
    alloc.register_full_pages(pages, page_hashes([1, 2, 3, 4], 2))
    alloc.free(pages[:1])
    alloc.reset_prefix_cache()
    checked(alloc)
    alloc.free(pages[1:])
    assert alloc.num_free_pages == 3
    checked(alloc)


def test_random_operations_keep_the_invariant():
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=32, page_size=2)
    owned: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and alloc.num_free_pages:
            n = rng.randint(1, alloc.num_free_pages)
            pages = alloc.allocate(n)
            tokens = [rng.randint(0, 3) for _ in range(2 * n)]
            alloc.register_full_pages(pages, page_hashes(tokens, 2))
            owned.append(pages)
        elif op < 0.6 and owned:
            pages = rng.choice(owned)
            alloc.share(pages)
            owned.append(list(pages))
        elif op < 0.8:
            tokens = [rng.randint(0, 3) for _ in range(8)]
            hit = alloc.lookup_prefix(page_hashes(tokens, 2), 4)
            if hit:
                owned.append(hit)
        elif owned:
            alloc.free(owned.pop(rng.randrange(len(owned))))
        alloc.check_invariants()
    for pages in owned:
        alloc.free(pages)
    alloc.check_invariants()
    assert alloc.num_used_pages == 0
