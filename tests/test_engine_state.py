"""CUDA-free engine state: pipeline transitions, page allocator, prefix cache, and randomized
interleavings of admit / cancel / finish driven straight through the scheduler."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from image_pipeline import PreparedImage, prepare_pil, sample_image
from vlm_server.engine.api import Emitted, EngineError, Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.pages import SINK_PAGE, OutOfPages, PageAllocator
from vlm_server.engine.core.pipeline import LaunchKind, PipelineError, PipelineState
from vlm_server.engine.core.prefix_cache import PrefixCache
from vlm_server.engine.core.step_plan import Chunk, StepPlan
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel


def test_pipeline_depth_two_cycle() -> None:
    p = PipelineState(depth=2)
    a = p.launch(LaunchKind.MIXED, ["x"], StepPlan(0, [Chunk(0, 3, final=True)]))
    p.mark_finalized(a)
    b = p.launch(LaunchKind.DECODE, ["x"])
    assert not p.can_launch()
    with pytest.raises(PipelineError):
        p.launch(LaunchKind.DECODE, [])  # a third step in flight
    assert p.pop_oldest() is a  # FIFO
    with pytest.raises(PipelineError):
        p.launch(LaunchKind.DECODE, [])  # a's slot is still being read by its commit
    p.complete(a)
    p.mark_finalized(b)
    c = p.launch(LaunchKind.DECODE, ["x"])
    assert c.slot == a.slot  # ping-pong
    with pytest.raises(PipelineError):
        p.complete(a)  # twice


def test_pipeline_illegal_orders_raise() -> None:
    p = PipelineState(depth=2)
    a = p.launch(LaunchKind.DECODE, [])
    with pytest.raises(PipelineError):
        p.pop_oldest()  # commit before finalize
    b_state = PipelineState(depth=2)
    x = b_state.launch(LaunchKind.DECODE, [])
    y = b_state.launch(LaunchKind.DECODE, [])
    with pytest.raises(PipelineError):
        b_state.mark_finalized(y)  # finalize out of launch order
    b_state.mark_finalized(x)
    with pytest.raises(PipelineError):
        b_state.mark_finalized(x)
    p.mark_finalized(a)
    blocking = PipelineState(depth=1)
    blocking.launch(LaunchKind.DECODE, [])
    assert not blocking.can_launch()
    with pytest.raises(ValueError):
        PipelineState(depth=3)


def test_page_allocator_refcounts_and_sink() -> None:
    alloc = PageAllocator(n_pages=8, page_size=4, max_rows=2, max_pages_per_row=4)
    assert alloc.free_pages == 7 and alloc.pages_for(9) == 3
    pages = alloc.allocate(3)
    assert SINK_PAGE not in pages
    alloc.retain(pages[:1])
    alloc.assign(1, pages)
    assert alloc.take_dirty() == [1] and alloc.take_dirty() == []
    assert list(alloc.block_table[1]) == [*pages, SINK_PAGE]
    alloc.release(pages)
    assert alloc.free_pages == 6  # the retained page is still held
    alloc.release(pages[:1])
    assert alloc.free_pages == 7
    with pytest.raises(AssertionError):
        alloc.release(pages[:1])
    with pytest.raises(OutOfPages):
        alloc.allocate(8)
    with pytest.raises(AssertionError):
        alloc.release([SINK_PAGE])


def test_prefix_cache_lru_eviction_only_when_idle() -> None:
    alloc = PageAllocator(n_pages=12, page_size=4, max_rows=1, max_pages_per_row=4)
    cache = PrefixCache(alloc, prefix_len=10, max_entries=8)  # 3 pages, last one partial
    a = cache.create("a")
    assert len(a.full_pages) == 2 and a.tail_page is not None and a.users == 1
    b = cache.create("b")
    cache.release(b)
    cache.release(a)
    assert cache.lookup("a") is a and cache.hits == 1  # a is now most recently used
    cache.acquire(a)
    assert cache.evict_for(alloc.free_pages + 3)  # evicts b, the idle one
    assert cache.peek("b") is None and cache.peek("a") is a
    assert not cache.evict_for(alloc.free_pages + 3)  # a is in use
    cache.release(a)
    cache.clear()
    assert alloc.used_pages == 0


def test_a_prefix_still_being_computed_is_never_evicted() -> None:
    """Its pages are being written on the prefill stream: freeing them for another sequence
    would race that work, even once no sequence holds the entry."""
    alloc = PageAllocator(n_pages=8, page_size=4, max_rows=1, max_pages_per_row=4)
    cache = PrefixCache(alloc, prefix_len=8, max_entries=1)
    a = cache.create("a")
    a.ready = False
    cache.release(a)  # its only user cancelled
    assert cache.evictable_pages() == 0
    assert not cache.evict_for(alloc.free_pages + 1)
    cache.create("b")  # over max_entries: still not evicted
    assert cache.peek("a") is a
    a.ready = True
    assert cache.evictable_pages() == 2 and cache.evict_for(alloc.free_pages + 2)
    assert cache.peek("a") is None


@pytest.fixture(scope="module")
def _threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_images() -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base.resize((320, 240))), prepare_pil(base.resize((240, 320)))]


_ACTIONS = st.lists(
    st.tuples(st.sampled_from(["submit", "cancel", "tick", "tick", "tick"]), st.integers(0, 1000)),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=_ACTIONS, depth=st.sampled_from([1, 2]), budget=st.sampled_from([4, 6, 1024]))
def test_random_interleavings_leave_nothing_behind(
    _threads: None,
    tiny: LoadedModel,
    two_images: list[PreparedImage],
    actions: list[tuple[str, int]],
    depth: int,
    budget: int,
) -> None:
    """Admit, cancel and tick in random orders (the scheduler driven by hand, no thread),
    with prompts whole or prefilled in chunks of one to three tokens: every request ends
    exactly once, and then every page, row and slot is free."""

    engine = BatchedEngine(
        tiny,
        EngineConfig(
            pipeline_depth=depth,
            max_batch_size=3,
            max_step_tokens=budget,
            kv_budget_bytes=3 << 20,
            prefix_cache_entries=1,
        ),
    )
    s = engine.scheduler
    routes: list[_Recorded] = []
    tickets = []
    for action, n in actions:
        if action == "submit":
            task = [Task.CAPTION, Task.QUERY, Task.POINT, Task.DETECT][n % 4]
            image = two_images[n % 2] if n % 5 or task is not Task.QUERY else None
            req = GenerationRequest(
                task,
                image,
                question="q",
                object_name="o",
                temperature=n % 2,
                max_tokens=1 + n % 7,
                max_objects=1 + n % 3,
                seed=n,
            )
            route = _Recorded()
            tickets.append(engine.admit(req, route))  # nothing slow: queued before it returns
            assert route.outcome == ["accepted"]
            routes.append(route)
        elif action == "cancel" and tickets:
            tickets[n % len(tickets)].cancel()
        else:
            s.waiting.extend(engine._inbox)
            engine._inbox.clear()
            s.tick()
    s.waiting.extend(engine._inbox)
    engine._inbox.clear()
    for _ in range(10_000):
        if not s.has_work():
            break
        s.tick()
    for route in routes:
        finals = [e for e in route.events if isinstance(e, Finished | EngineError)]
        assert len(finals) == 1
    assert not s.zombies and not s.running and not s.waiting
    assert all(x is None for x in s.pipe.slots)
    assert len(s.free_rows) == engine.cfg.max_rows
    s.prefix_cache.clear()
    assert engine.scheduler.pages.used_pages == 0


class _Recorded:
    """A route that keeps what it hears (engine/intake.py)."""

    def __init__(self) -> None:
        self.outcome: list[object] = []
        self.events: list[Emitted] = []

    def accepted(self) -> None:
        self.outcome.append("accepted")

    def refused(self, error: EngineError) -> None:
        self.outcome.append(error)

    def emit(self, event: Emitted) -> None:
        self.events.append(event)


def test_prefix_watcher_wakes_once_per_batch_and_survives_a_failed_wait() -> None:
    import threading

    from vlm_server.engine.engine import _Watcher

    woken = threading.Semaphore(0)
    waited: list[str] = []

    def wait(handle: object) -> None:
        name, ready = handle  # type: ignore[misc]
        waited.append(name)
        if name == "bad":
            raise RuntimeError("device error")
        assert ready.wait(5)

    watcher = _Watcher(wait, woken.release, "prefix-watcher")
    first, second = threading.Event(), threading.Event()
    batch_a, batch_b, batch_c = object(), object(), object()
    watcher.watch(batch_a, ("a", first))
    watcher.watch(batch_a, ("a again", first))  # the same batch: no second wait
    assert not woken.acquire(timeout=0.05)  # not before the batch is done
    first.set()
    assert woken.acquire(timeout=5)
    watcher.watch(batch_b, ("bad", second))
    assert woken.acquire(timeout=5)  # a failed wait still wakes the scheduler
    second.set()
    watcher.watch(batch_c, ("c", second))
    assert woken.acquire(timeout=5)  # and the watcher goes on
    assert waited == ["a", "bad", "c"]
    watcher.close()
    watcher._thread.join(5)
    assert not watcher._thread.is_alive()


def test_a_step_wait_ends_with_the_step_or_with_arrivals_first() -> None:
    """The engine's commit wait (scheduler.step_wait): requests arriving before the step's
    results end it early and join the queue; the results end it otherwise, and a second wait
    for the same step waits on the same watch."""
    import threading
    from types import SimpleNamespace

    from vlm_server.engine.core.pipeline import LaunchKind, Step
    from vlm_server.engine.engine import BatchedEngine, _Watcher

    landed = threading.Event()
    waits: list[int] = []

    def wait_outputs(slot: object) -> None:
        waits.append(slot)  # type: ignore[arg-type]
        assert landed.wait(5)

    engine = BatchedEngine.__new__(BatchedEngine)  # the wait's state only, no model
    engine._cv = threading.Condition()
    engine._inbox = []
    engine._step_done = False
    engine._step_watcher = _Watcher(wait_outputs, engine._on_step_done, "step-watcher")

    queue = SimpleNamespace(waiting=[])
    engine.scheduler = queue  # type: ignore[assignment]
    step = Step(0, 1, LaunchKind.DECODE, [])
    with engine._cv:
        engine._inbox.append("arrival")  # type: ignore[arg-type]
    assert engine._wait_step(step) is False
    assert queue.waiting == ["arrival"] and not engine._inbox
    timer = threading.Timer(0.05, landed.set)
    timer.start()
    assert engine._wait_step(step) is True
    assert waits == [1]  # one watch of the step's slot for both waits
    engine._step_watcher.close()
    timer.join()
