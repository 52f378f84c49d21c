"""Headroom for interactive requests: what background work may hold (CUDA-free).

A request of priority below 0 is background work (batch jobs). Admission already takes the
highest priority first (core/wait_queue.py), but a request arriving while background work holds
every row, page and prefix slot would still wait for some of it to finish. So background
sequences are held within limits that leave an interactive request room at once:

- rows: at most ``max_batch_size - reserved`` background sequences run (``reserved`` is
  `EngineConfig.reserved_rows`);
- KV pages: background admission leaves at least `Headroom.pages` free (cached prefixes no
  sequence holds count as free: they are evicted on demand). That is what ``reserved`` new
  picture requests take at worst (`typical_request_pages`), capped so that the largest request
  a row can hold still fits an idle pool beside it: background work never starves for pages;
- prefix slots: a batch of new image prefixes holding background pictures holds at most
  ``background_prefill_batch`` pictures, and only one such batch is in flight on the prefill
  stream (which runs in order), so an interactive picture waits behind one small background
  batch at most, and another prefix slot is always left to it (with ``prefill_batches`` >= 2).

Interactive requests take rows, pages and slots as before, the reserve included: these limits
only ever hold background work back. The order is the queue's: admission stops at a head it
cannot admit, so no lower priority is admitted in its place.
"""

from __future__ import annotations

from vlm_server.engine.api import GenerationRequest
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import typical_positions
from vlm_server.engine.core.prefix_cache import PrefixCache, PrefixEntry

# Background work yields (EngineConfig.background_yield) at most this many times in a row:
# then a step carries its rows, or a batch of its pictures starts beside the interactive lane,
# so that interactive traffic that never pauses still leaves it progress.
YIELDS_IN_A_ROW = 4


def is_background(request: GenerationRequest) -> bool:
    return request.priority < 0


def typical_request_pages(cache: PrefixCache, row_pages: int) -> int:
    """Free pages a typical new picture request takes at worst (its prefix not cached), within
    a block-table row of ``row_pages`` pages."""
    # The memory plan's typical request (a picture, a short question, the default output).
    positions = typical_positions(cache.prefix_len, row_pages * cache.alloc.page_size)
    return cache.pages_with_new_prefix(positions)


def reserve_pages(reserved_rows: int, cache: PrefixCache, row_pages: int) -> int:
    """The free pages background admission leaves: ``reserved_rows`` typical picture requests'
    worth, at most the pool less what a request filling a whole row takes at worst."""
    if not reserved_rows:
        return 0
    largest = cache.pages_with_new_prefix(row_pages * cache.alloc.page_size)
    usable = cache.alloc.n_pages - 1  # the sink page is never handed out
    return max(0, min(reserved_rows * typical_request_pages(cache, row_pages), usable - largest))


class Headroom:
    """The limits background sequences are held within, and what they hold now."""

    def __init__(self, cfg: EngineConfig, cache: PrefixCache, row_pages: int) -> None:
        self.max_rows = cfg.max_batch_size - cfg.reserved_rows
        self.pages = reserve_pages(cfg.reserved_rows, cache, row_pages)
        self.prefill_batch = cfg.background_prefill_batch
        self.rows = 0  # background sequences running (admitted, not finished)
        # A new prefix of the batch in flight that holds background pictures (None: none).
        self._batch: PrefixEntry | None = None

    def admits(self, in_batch: int, pages_left: int) -> bool:
        """Whether one more background sequence may run, leaving ``pages_left`` pages free;
        ``in_batch`` >= 0: its new image prefix joins a batch of that many new pictures so
        far (the batch stays small, and no other background batch is in flight)."""
        if self.rows >= self.max_rows or pages_left < self.pages:
            return False
        if in_batch < 0:
            return True
        return in_batch < self.prefill_batch and (self._batch is None or self._batch.ready)

    def launched_batch(self, entry: PrefixEntry) -> None:
        """A batch holding background pictures went to the prefill stream; ``entry`` is one
        of its new prefixes (ready once the batch completed)."""
        self._batch = entry

    def started(self, request: GenerationRequest) -> None:
        if is_background(request):
            self.rows += 1

    def ended(self, request: GenerationRequest) -> None:
        if is_background(request):
            self.rows -= 1
