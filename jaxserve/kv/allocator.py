"""KV-cache page allocator with reference counts and a prefix cache. Host-side bookkeeping only: no jax.

Every page except the null page 0 is in exactly one state:

    free     refcount 0, content worthless           in `_free` (handed out first, FIFO)
    used     refcount >= 1                            counted in `_refcount`
    cached   refcount 0, holds a full page of known   in `_evictable` (LRU order: evicted first = oldest)
             tokens and is findable by its hash

    free + used + cached == num_pages - 1            (check_invariants)

A full page is identified by a chained hash of its tokens and every token before it, so two sequences with the
same prefix map to the same pages. Sharing a page only increments its refcount; a page is reusable for other
content once its refcount drops to 0 and it is evicted.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised by allocate() when fewer pages are free than asked for; callers check can_allocate() first."""


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page of tokens given the hash of everything before it (b"" for the first page)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, known: Sequence[bytes] = (), salt: bytes = b""
                ) -> list[bytes]:
    """Chained hashes of every full page of `token_ids`, extending the already computed prefix `known`. `salt`
    stands before the first page: what else the K/V depend on (the LoRA adapter), so equal tokens under another
    adapter never share pages."""
    hashes = list(known)
    for start in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        hashes.append(chain_hash(hashes[-1] if hashes else salt, token_ids[start:start + page_size]))
    return hashes


def adapter_salt(adapter_id: int) -> bytes:
    """The page-hash salt of sequences run with LoRA adapter `adapter_id` (0, no adapter: none)."""
    return b"" if adapter_id == 0 else hashlib.blake2b(b"lora:%d" % adapter_id, digest_size=16).digest()


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class PageAllocator:
    """Pages 1..num_pages-1 of a paged KV cache. `enable_prefix_caching=False` makes cached pages plain free ones."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._refcount = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> hash, for cached and used pages that hold a full page
        self._page_of: dict[bytes, int] = {}  # hash -> page
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.stats = PrefixCacheStats()

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an allocate() call can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - self.num_free_pages

    @property
    def usage(self) -> float:
        return self.num_used_pages / (self.num_pages - 1)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    # ---- allocate / share / free ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh pages (refcount 1). Takes free pages first, then evicts the least recently cached ones."""
        if not self.can_allocate(n):
            raise OutOfPagesError(f"asked for {n} KV pages, {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            page = self._free.popleft() if self._free else self._evict_oldest()
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more owner for each page (a forked sample sharing its parent's prompt pages)."""
        for page in pages:
            self._take_ref(page)

    def free(self, pages: Sequence[int]) -> None:
        """Drops one reference per page. Freed in reverse so a sequence's tail is evicted before its head."""
        for page in reversed(pages):
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} freed more often than it was allocated")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    # ---- prefix cache ---------------------------------------------------------------------------------------
    def lookup_prefix(self, hashes: Sequence[bytes], max_pages: int) -> list[int]:
        """Takes a reference on the cached pages for the longest prefix of `hashes` (at most max_pages)."""
        self.stats.queries += max_pages * self.page_size
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in hashes[:max_pages]:
            page = self._page_of.get(h)
            if page is None:
                break
            self._take_ref(page)
            pages.append(page)
        self.stats.hits += len(pages) * self.page_size
        return pages

    def register_full_pages(self, pages: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Makes pages findable by hash: pages[i] holds the tokens hashed by hashes[i]. A hash already owned by
        another page keeps that page (this one stays anonymous and is freed normally)."""
        if not self.enable_prefix_caching:
            return
        for page, h in zip(pages, hashes):
            if page in self._hash_of or h in self._page_of:
                continue
            self._hash_of[page] = h
            self._page_of[h] = page

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page (used pages keep their content but lose their hash)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._page_of.clear()

    # ---- internals ------------------------------------------------------------------------------------------
    def _take_ref(self, page: int) -> None:
        if page == NULL_PAGE:
            raise ValueError("the null page is never shared")
        if self._refcount[page] == 0:
            if page not in self._evictable:
                raise ValueError(f"page {page} is free; only used or cached pages can be shared")
            del self._evictable[page]
        self._refcount[page] += 1

    def _evict_oldest(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent. Tests call it after every operation."""
        free, cached = set(self._free), set(self._evictable)
        used = {p for p in range(1, self.num_pages) if self._refcount[p] > 0}
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert not (free & cached) and not (free & used) and not (cached & used), "a page is in two states"
        assert len(free) + len(used) + len(cached) == self.num_pages - 1, (
            f"free {len(free)} + used {len(used)} + cached {len(cached)} != {self.num_pages - 1}")
        assert NULL_PAGE not in free | cached | used and self._refcount[NULL_PAGE] == 0, "null page handed out"
        assert all(self._refcount[p] == 0 for p in free | cached), "a free or cached page has references"
        assert cached <= set(self._hash_of), "a cached page has no hash"
        assert not (free & set(self._hash_of)), "a free page still has a hash"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash index out of sync"
        assert len(self._page_of) == len(self._hash_of), "hash index out of sync"
