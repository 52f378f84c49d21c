"""Priorities in the scheduler (engine/core/scheduler.py, headroom.py), on a runtime without
a model (tests/support/script_runtime.py) and driven tick by tick: admission by priority, then
arrival; background work (priority < 0) held within its rows, pages and one small prefix batch,
so that interactive requests arriving later are admitted at once; no lower priority admitted
in place of a higher one that waits; and background work alone takes all its limits allow.
Then seeded random arrivals, priorities, pictures and prefix completions keep every rule at
every tick, and every request ends."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from decoding.text_grammar import TextGrammar
from tests.support.script_runtime import Batch, ScriptRuntime
from vlm_server.engine.api import (
    BATCH_PRIORITY,
    EngineError,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import BACKGROUND_YIELD, EngineConfig
from vlm_server.engine.core.headroom import reserve_pages, typical_request_pages
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.pipeline import Step
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.core.sequence import Sequence

PAGE = 16
PREFIX = 40  # BOS + image positions: three pages, the last partly filled
ROW_PAGES = 64  # 1024 positions a row
EOS = 0


@dataclass(frozen=True)
class Picture:
    """What the scheduler reads of an image: the key of its prefix."""

    content_hash: str


class Steps(Observer):
    """Counts the steps launched and committed."""

    def __init__(self) -> None:
        self.launched_n = self.committed_n = 0

    def launched(self, step: Step) -> None:
        self.launched_n += 1

    def committed(self, step: Step) -> None:
        self.committed_n += 1


class Harness:
    """A scheduler on the script runtime, with what each tick admitted."""

    def __init__(
        self,
        *,
        max_batch_size: int = 8,
        reserved: int = 2,
        kv_pages: int = 4000,
        prefix_slots: int = 2,
        prefill_batch: int = 2,
        depth: int = 2,
        interactive_batch: int = 0,
        riding: int = 0,
        background_yield: str = "off",
        decode_pace_ms: float = 0.0,
        background_pace_ms: float = 0.0,
    ) -> None:
        self.cfg = EngineConfig(
            decode_pace_ms=decode_pace_ms,
            background_pace_ms=background_pace_ms,
            background_yield=background_yield,
            max_batch_size=max_batch_size,
            background_reserved_rows=reserved,
            background_prefill_batch=prefill_batch,
            interactive_prefill_batch=interactive_batch,
            prefix_prompt_tokens=riding,
            pipeline_depth=depth,
            page_size=PAGE,
            max_step_tokens=256,
        )
        self.rt = ScriptRuntime(
            kv_pages,
            self.cfg.max_rows,
            ROW_PAGES,
            prefix_slots,
            prefix_prompt_tokens=riding,
            interactive_prefix_slots=prefix_slots if interactive_batch else 0,
            interactive_prefill_batch=interactive_batch,
        )
        self.steps = Steps()
        self.s = Scheduler(self.rt, self.cfg, EOS, PREFIX, observer=self.steps)
        self.submitted: list[Sequence] = []
        self.order: list[Sequence] = []  # admission order
        self.last: list[Sequence] = []  # admitted by the last tick
        self.first_token: dict[str, int] = {}  # request id -> the tick that committed it
        self.ends: dict[str, Finished | EngineError] = {}
        self.ticks = 0
        self.injected: list[Sequence] = []  # arrived during a tick's commit wait

    def arrive_while_waiting(self, arrivals: Callable[[], Sequence | None]) -> None:
        """Give the scheduler a commit wait (as the engine's) during which ``arrivals`` may
        submit a request: a wait ends early (False) when one arrived, else with the step."""

        def wait(step: Step) -> bool:
            seq = arrivals()
            if seq is None:
                return True
            self.injected.append(seq)
            return False

        self.s.step_wait = wait

    def submit(
        self,
        name: str,
        priority: int = 0,
        image: str | None = None,
        max_tokens: int = 4,
        prompt: int = 3,
    ) -> Sequence:
        request = GenerationRequest(
            Task.QUERY,
            Picture(image) if image is not None else None,  # type: ignore[arg-type]
            request_id=name,
            max_tokens=max_tokens,
            priority=priority,
        )
        seq = Sequence(
            request,
            list(range(1, prompt + 1)),
            TextGrammar(EOS, max_tokens),
            PREFIX if image else 0,
        )
        seq.emit = lambda event, rid=name: self._on_event(rid, event)
        self.submitted.append(seq)
        self.s.waiting.append(seq)
        return seq

    def _on_event(self, rid: str, event: object) -> None:
        if isinstance(event, Finished | EngineError):
            assert rid not in self.ends, f"{rid} ended twice"
            self.ends[rid] = event

    def tick(self) -> list[Sequence]:
        """One tick; returns the sequences it admitted, in admission order."""
        before = {id(s) for s in self.order}
        waiting_before = list(self.s.waiting)
        self.injected = []
        in_flight = self.s.pipe.n_in_flight
        moved = self.steps.launched_n + self.steps.committed_n
        self.s.tick()
        if in_flight:  # a tick with steps in flight launches or commits one: it never spins
            assert self.steps.launched_n + self.steps.committed_n > moved
        self.ticks += 1
        self.last = [s for s in self.s.running if id(s) not in before]
        self.order.extend(self.last)
        for seq in self.s.running:
            rid = seq.request.request_id
            if seq.grammar.token_ids and rid not in self.first_token:
                self.first_token[rid] = self.ticks
        self.check(waiting_before)
        return self.last

    def check(self, waiting_before: list[Sequence]) -> None:
        """The rules of priorities and headroom, after every tick."""
        s, room = self.s, self.s.headroom
        background = [q for q in s.running if q.request.priority < 0]
        assert room.rows == len(background) <= room.max_rows
        # Admitted: the head of the queue as it stood, in its order (arrivals during the
        # commit wait joined it by priority, after those of equal priority).
        queue = sorted(waiting_before + self.injected, key=lambda q: -q.request.priority)
        assert self.last == queue[: len(self.last)]
        # A new picture's batch holding background pictures: small, and only one in flight.
        pending = {id(e.pending): e.pending for e in s.pending_prefixes}
        with_background = [
            b
            for b in pending.values()
            if any(
                q.prefix is not None and q.prefix.pending is b and not q.prefix_hit
                for q in background
            )
        ]
        assert len(with_background) <= 1
        for batch in with_background:
            assert isinstance(batch, Batch) and len(batch.jobs) <= self.cfg.background_prefill_batch
            assert not batch.interactive
        # The interactive lane: interactive pictures only, small batches, its own slots.
        lane = [b for b in pending.values() if b.interactive]
        assert len(lane) <= self.rt.interactive_prefix_slots
        assert len(pending) - len(lane) <= self.rt.prefix_slots
        assert all(len(b.jobs) <= self.rt.interactive_prefill_batch for b in lane)
        if any(q.request.priority < 0 for q in self.last):
            assert s.prefix_cache.free_for(None) >= room.pages

    def run(self, limit: int = 2000, prefixes_every: int = 1) -> None:
        """Tick until no work is left, completing the prefix batches every few ticks."""
        for i in range(limit):
            if not self.s.has_work():
                return
            if i % prefixes_every == 0:
                self.rt.finish_batches()
            self.tick()
        raise AssertionError(f"work left after {limit} ticks")

    def all_ended(self) -> None:
        assert sorted(self.ends) == sorted(q.request.request_id for q in self.submitted)
        assert all(isinstance(e, Finished) for e in self.ends.values())
        s = self.s
        assert not s.running and not s.zombies and not s.waiting and not s.headroom.rows
        assert len(s.free_rows) == self.cfg.max_rows
        s.prefix_cache.clear()
        assert s.pages.used_pages == 0


def _names(seqs: list[Sequence]) -> list[str]:
    return [q.request.request_id for q in seqs]


def test_admission_follows_priority_then_arrival() -> None:
    h = Harness(max_batch_size=3, reserved=0)
    rng = random.Random(7)
    for i in range(14):
        h.submit(f"r{i}", priority=rng.randint(-10, 10), max_tokens=1 + i % 3)
    h.run()
    want = sorted(h.submitted, key=lambda q: -q.request.priority)  # stable: arrival order
    assert _names(h.order) == _names(want)
    h.all_ended()


def test_a_late_interactive_request_is_admitted_before_queued_background_ones() -> None:
    h = Harness(max_batch_size=4, reserved=1)
    for i in range(20):
        h.submit(f"bg{i}", priority=BATCH_PRIORITY, max_tokens=6)
    for _ in range(3):
        h.tick()
    assert len(h.s.running) == 3 and len(h.s.waiting) == 17  # the reserved row is free
    queued = _names(list(h.s.waiting))
    h.submit("urgent", priority=5, max_tokens=6)
    assert _names(h.tick()) == ["urgent"]
    h.run()
    assert _names(h.order)[3:] == ["urgent", *queued]
    first = h.first_token
    assert all(first["urgent"] < first[name] for name in queued)
    h.all_ended()


@pytest.mark.parametrize("reserved", [0, 1, 3])
def test_background_rows_leave_the_reserved_rows_to_interactive_requests(reserved: int) -> None:
    h = Harness(max_batch_size=8, reserved=reserved)
    for i in range(30):
        h.submit(f"bg{i}", priority=-1, max_tokens=40)
    for _ in range(4):
        h.tick()
    # Background alone takes all its limit allows, and no more.
    assert len(h.s.running) == 8 - reserved and h.s.headroom.rows == 8 - reserved
    for i in range(reserved):
        h.submit(f"i{i}", priority=0, max_tokens=40)
    h.tick()
    assert len(h.s.running) == 8
    assert _names(h.last) == [f"i{i}" for i in range(reserved)]
    h.run()
    h.all_ended()


def test_the_page_reserve_is_what_the_reserved_rows_of_typical_pictures_take() -> None:
    h = Harness(reserved=2, kv_pages=300)
    cache = h.s.prefix_cache
    # A picture (3 pages, two shared), 64 prompt tokens and 768 to write: 55 pages of
    # positions, 56 free pages at worst.
    assert typical_request_pages(cache, ROW_PAGES) == 56
    assert h.s.headroom.pages == reserve_pages(2, cache, ROW_PAGES) == 2 * 56
    assert reserve_pages(0, cache, ROW_PAGES) == 0
    # Capped: a request filling a whole row (65 pages at worst) still fits beside it.
    assert reserve_pages(5, cache, ROW_PAGES) == 299 - 65
    small = Harness(reserved=2, kv_pages=60)
    assert small.s.headroom.pages == 0  # the pool holds one largest request at most


def test_background_leaves_the_page_reserve_and_interactive_pictures_find_it() -> None:
    h = Harness(max_batch_size=32, reserved=2, kv_pages=300)
    reserve = h.s.headroom.pages
    for i in range(40):
        h.submit(f"bg{i}", priority=BATCH_PRIORITY, max_tokens=200)  # 13 pages each
    for _ in range(4):
        h.tick()
    # Pages bind before rows: as many as keep the reserve free, then no more.
    assert h.s.headroom.rows == (299 - reserve) // 13 == 14
    assert h.s.prefix_cache.free_for(None) >= reserve
    h.submit("a", image="pa", prompt=64, max_tokens=768)
    h.submit("b", image="pb", prompt=64, max_tokens=768)
    assert _names(h.tick()) == ["a", "b"]
    h.run()
    h.all_ended()


def test_background_pictures_take_one_small_prefix_batch() -> None:
    h = Harness(reserved=2, prefix_slots=2, prefill_batch=2)
    for i in range(6):
        h.submit(f"bg{i}", priority=-3, image=f"p{i}")
    assert _names(h.tick()) == ["bg0", "bg1"]
    assert [len(b.jobs) for b in h.rt.batches] == [2]
    for _ in range(3):  # its batch still runs: no second background batch
        assert h.tick() == []
        # Nothing to do but wait for it: the engine's thread may sleep.
        assert h.s.stalled_on_prefixes()
    h.submit("urgent", priority=0, image="new")
    assert _names(h.tick()) == ["urgent"]
    assert [len(b.jobs) for b in h.rt.batches] == [2, 1]  # the other slot, at once
    h.rt.batches[0].done = True
    # The tick that sees the background batch done starts the next one.
    assert _names(h.tick()) == ["bg2", "bg3"]
    h.run()
    assert [len(b.jobs) for b in h.rt.batches] == [2, 1, 2, 2]
    h.all_ended()


@pytest.mark.parametrize(("interactive", "batch"), [(1, ["i0", "bg0"]), (2, ["i0", "i1"])])
def test_background_pictures_join_a_batch_only_while_it_is_small(
    interactive: int, batch: list[str]
) -> None:
    h = Harness(reserved=2, prefix_slots=2, prefill_batch=2)
    for i in range(interactive):
        h.submit(f"i{i}", priority=1, image=f"pi{i}")
    for i in range(3):
        h.submit(f"bg{i}", priority=-10, image=f"pb{i}")
    assert _names(h.tick()) == batch
    h.run()
    h.all_ended()


def test_a_waiting_head_is_not_passed_by_lower_priorities() -> None:
    """The head waits for pages; a smaller request behind it that would fit waits too."""
    h = Harness(max_batch_size=8, reserved=0, kv_pages=100)
    h.submit("big", priority=2, max_tokens=900)  # 57 of the 99 pages
    h.tick()
    h.submit("next", priority=3, max_tokens=900)  # does not fit beside it
    h.submit("small", priority=1, max_tokens=4)  # would fit
    h.submit("bg", priority=-10, max_tokens=4)  # would fit
    for _ in range(50):
        assert h.tick() == []
    h.run()
    assert _names(h.order) == ["big", "next", "small", "bg"]
    h.all_ended()


def test_background_alone_takes_every_row_its_limit_allows_and_all_finish() -> None:
    h = Harness(max_batch_size=6, reserved=2, prefill_batch=2)
    for i in range(40):
        image = f"p{i % 5}" if i % 3 else None  # shared pictures and text
        h.submit(f"bg{i}", priority=-1 - i % 3, image=image, max_tokens=2 + i % 7)
    most = 0
    for _ in range(3000):
        if not h.s.has_work():
            break
        h.rt.finish_batches()
        h.tick()
        most = max(most, h.s.headroom.rows)
    assert most == 4
    h.all_ended()


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_keeps_the_rules_and_every_request_ends(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(
        max_batch_size=rng.choice([2, 4, 6]),
        reserved=rng.choice([0, 1]),
        kv_pages=rng.choice([160, 400, 2000]),
        prefix_slots=rng.choice([1, 2, 3]),
        prefill_batch=rng.choice([1, 2]),
        depth=rng.choice([1, 2]),
        interactive_batch=rng.choice([0, 1, 3]),
        riding=rng.choice([0, 16]),
        background_yield=rng.choice(BACKGROUND_YIELD),
    )
    made = 0

    def submit() -> Sequence:
        nonlocal made
        made += 1
        return h.submit(
            f"r{made}",
            priority=rng.choice([-10, -3, 0, 2, 5]),
            image=rng.choice([None, "a", "b", f"u{made}"]),
            max_tokens=rng.randint(1, 60),
            prompt=rng.randint(1, 20),
        )

    if rng.random() < 0.5:
        h.arrive_while_waiting(lambda: submit() if rng.random() < 0.3 and made < 600 else None)
    for _ in range(400):
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            submit()
        if rng.random() < 0.4:
            for batch in h.rt.batches:
                batch.done = batch.done or rng.random() < 0.7
        h.tick()
    h.run(limit=100_000, prefixes_every=2)
    h.all_ended()
    assert made > 100


def test_engine_config_checks_the_headroom_flags() -> None:
    assert EngineConfig().reserved_rows == 4
    assert EngineConfig(max_batch_size=3).reserved_rows == 2  # auto: below the batch
    assert EngineConfig(max_batch_size=1).reserved_rows == 0
    assert EngineConfig(max_batch_size=8, background_reserved_rows=0).reserved_rows == 0
    with pytest.raises(ValueError, match=r"^background_reserved_rows must be below max_batch_size"):
        EngineConfig(max_batch_size=4, background_reserved_rows=4)
    with pytest.raises(ValueError, match=r"^background_reserved_rows must be >= 0"):
        EngineConfig(background_reserved_rows=-2)
    with pytest.raises(ValueError, match=r"^background_prefill_batch must be >= 1"):
        EngineConfig(background_prefill_batch=0)
