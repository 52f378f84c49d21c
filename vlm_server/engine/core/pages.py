"""Host-side page allocator and block table for the paged KV cache (CUDA-free).

Invariants:
  P1 page 0 is the sink: never handed out; padding rows and unused block-table entries point
     at it, so stray writes land somewhere harmless.
  P2 a page is free exactly when its reference count is 0; shared pages (an image prefix used
     by several sequences) are counted once per holder.
  P3 the block table is a host mirror (the runtime's pinned memory); rows changed since the
     last upload are marked dirty, and the scheduler hands them to its next launch, which
     copies them to the device in one transfer before the forward.
"""

from __future__ import annotations

import numpy as np

SINK_PAGE = 0


class OutOfPages(RuntimeError):
    """Not enough free pages (admission checks first, so this signals a bookkeeping bug)."""


class PageAllocator:
    def __init__(
        self,
        n_pages: int,
        page_size: int,
        max_rows: int,
        max_pages_per_row: int,
        block_table: np.ndarray | None = None,
    ) -> None:
        if n_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the sink)")
        self.n_pages = n_pages
        self.page_size = page_size
        self.refcount = np.zeros(n_pages, dtype=np.int32)
        self.refcount[SINK_PAGE] = 1  # never freed
        self._free = list(range(n_pages - 1, 0, -1))  # pop() hands out low ids first
        shape = (max_rows, max_pages_per_row)
        # The scheduler passes the runtime's pinned mirror (a numpy view): the runtime
        # uploads rows from it without a pageable copy.
        self.block_table = np.zeros(shape, np.int32) if block_table is None else block_table
        if self.block_table.shape != shape:
            raise ValueError(f"block table must be {shape}")
        self.block_table[:] = SINK_PAGE
        self._dirty: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.n_pages - 1 - len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        if pages and (self.refcount[pages] <= 0).any():
            raise AssertionError("retain of a free page")
        np.add.at(self.refcount, pages, 1)

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if p == SINK_PAGE or self.refcount[p] <= 0:
                raise AssertionError(f"release of page {p} with refcount {self.refcount[p]}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def assign(self, row: int, pages: list[int]) -> None:
        """Point a row's block table at ``pages`` (the rest at the sink)."""
        if len(pages) > self.block_table.shape[1]:
            raise ValueError("sequence needs more pages than a block-table row holds")
        self.block_table[row, : len(pages)] = pages
        self.block_table[row, len(pages) :] = SINK_PAGE
        self._dirty.add(row)

    def clear(self, row: int) -> None:
        self.block_table[row] = SINK_PAGE
        self._dirty.add(row)

    def take_dirty(self) -> list[int]:
        rows = sorted(self._dirty)
        self._dirty.clear()
        return rows
