"""Image-prefix reuse: KV pages of BOS + image shared between requests (CUDA-free).

An entry holds the pages of one image prefix: the full pages are shared read-only by every
sequence that uses it; the last, partly filled page (when the prefix length is not a multiple
of the page size) is copied into each sequence's own page, since the sequence's prompt
continues in it. Entries are reference counted through the page allocator and evicted least
recently used, only when no running sequence holds them.

A new entry's pages are written by work on the device's prefill stream (image path and BOS +
image forward) while steps keep running: it is not ``ready`` until the scheduler saw that work
complete, and until then no step reads its pages and it is never evicted (its pages are still
being written).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from vlm_server.engine.core.memory_plan import picture_request_pages
from vlm_server.engine.core.pages import PageAllocator


@dataclass
class PrefixEntry:
    key: str
    full_pages: list[int]
    tail_page: int | None  # partly filled last page, or None
    users: int = 0
    ready: bool = True  # its pages hold the prefix (False while the device computes it)
    pending: object | None = None  # the runtime's handle of that computation
    interactive_lane: bool = False  # computed on the runtime's interactive prefill lane
    pages: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pages = self.full_pages + ([self.tail_page] if self.tail_page is not None else [])


class PrefixCache:
    def __init__(self, allocator: PageAllocator, prefix_len: int, max_entries: int = 256) -> None:
        self.alloc = allocator
        self.prefix_len = prefix_len
        self.max_entries = max_entries
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.hits = 0
        self.lookups = 0

    @property
    def pages_per_entry(self) -> int:
        return self.alloc.pages_for(self.prefix_len)

    @property
    def has_tail(self) -> bool:
        return self.prefix_len % self.alloc.page_size != 0

    def pages_with_new_prefix(self, positions: int) -> int:
        """Free pages a sequence of ``positions`` (its prefix included) takes when its prefix
        is not cached: the new entry's pages, and its own beyond the entry's full pages (its
        private copy of a partly filled last page included)."""
        return picture_request_pages(positions, self.prefix_len, self.alloc.page_size)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> PrefixEntry | None:
        """The entry for ``key`` (marked most recently used), or None."""
        self.lookups += 1
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: str) -> PrefixEntry | None:
        """The entry for ``key`` without counting a lookup or touching the LRU order."""
        return self._entries.get(key)

    def create(self, key: str) -> PrefixEntry:
        """Allocate pages for a new prefix, already acquired once by the caller (who made room
        with `evict_for`)."""
        pages = self.alloc.allocate(self.pages_per_entry)
        entry = (
            PrefixEntry(key, pages[:-1], pages[-1], users=1)
            if self.has_tail
            else PrefixEntry(key, pages, None, users=1)
        )
        self._entries[key] = entry
        while len(self._entries) > self.max_entries and self._evict_one():
            pass
        return entry

    def acquire(self, entry: PrefixEntry) -> None:
        entry.users += 1

    def release(self, entry: PrefixEntry) -> None:
        if entry.users <= 0:
            raise AssertionError("prefix entry released more often than acquired")
        entry.users -= 1

    def evictable_pages(self) -> int:
        return sum(len(e.pages) for e in self._entries.values() if _idle(e))

    def free_for(self, entry: PrefixEntry | None) -> int:
        """Pages free for a new user of ``entry`` (None: of no cached prefix): free and
        evictable ones, less the entry's own (used, so it cannot be evicted)."""
        free = self.alloc.free_pages + self.evictable_pages()
        if entry is not None and entry.users == 0:
            free -= len(entry.pages)
        return free

    def evict_for(self, n_pages: int) -> bool:
        """Evict idle entries (least recently used first) until ``n_pages`` are free."""
        while self.alloc.free_pages < n_pages:
            if not self._evict_one():
                return False
        return True

    def clear(self) -> None:
        while self._evict_one():
            pass

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():
            if _idle(entry):
                del self._entries[key]
                self.alloc.release(entry.pages)
                return True
        return False


def _idle(entry: PrefixEntry) -> bool:
    """Evictable: no sequence holds it and no device work still writes its pages."""
    return entry.users == 0 and entry.ready
