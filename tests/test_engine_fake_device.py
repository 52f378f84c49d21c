"""The real scheduler on a fake device (vlm_server/engine/fake_runtime.py) that checks the
pipeline invariants I1-I7 of DESIGN.md under seeded random interleavings of its streams.

Text, point and detect requests of different lengths, image-prefix hits and misses, page
pressure, cancellations and an expired deadline run at depth 1 and 2: nothing is flagged, and
the answers equal those of the blocking run. Then each removed wait, a slot reused before its
commit, zombie pages freed early and a second compute stream must each be caught.
"""

from __future__ import annotations

import inspect
import random
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from decoding.grammars import RegionRows, RegionTokens, TextGrammar, detect_grammar, point_grammar
from decoding.mask_table import NO_MASK, MaskTable
from image_pipeline import PreparedImage
from tests.support.fake_device import (
    DeviceViolation,
    EarlySlotReusePipeline,
    FakeDevice,
    FakeRuntime,
)
from vlm_server.engine.api import EngineError, ErrorCode, Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core import scheduler as scheduler_module
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.pipeline import PipelineState, Step
from vlm_server.engine.core.runtime_protocol import Runtime
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.weights.loader import LoadedModel

VOCAB, BOS, EOS, COORD = 40, 0, 1, 2
PAGE = 4
PREFIX = 10  # image prefix positions: not a page multiple, so prefixes have a tail page
MAX_CONTEXT = 96
N_REQUESTS = 48
SEEDS = list(range(6))
# Device operations run between two ticks, drawn from 0..burst: from a device that runs only
# during host waits to one that is nearly synchronous.
BURSTS = [0, 3, 8, 40]


def _image(i: int) -> PreparedImage:
    crops = torch.zeros((1, 2, 2, 3), dtype=torch.uint8)
    return PreparedImage(crops, (0, 0), f"image-{i}", 64, 48, (48, 64))


IMAGES = [_image(i) for i in range(3)]


def _sequence(i: int, table: MaskTable, region_rows: RegionRows) -> Sequence:
    """Request i: text without image, text with image, point, detect, in turn. Text masks are
    registered when the request arrives, so the device mask table grows mid-run."""
    kind = i % 4
    image = IMAGES[i % 3] if kind else None
    prompt = [3 + (7 * i + j) % 30 for j in range(2 + i % 5)]
    if kind <= 1:
        suppressed = [COORD, 3 + i % 5] if i % 3 == 0 else [COORD]
        grammar: Any = TextGrammar(
            EOS, 1 + (5 * i) % 12, row=table.allow_all_but(suppressed), first_row=NO_MASK
        )
        task = Task.QUERY if kind == 0 else Task.CAPTION
    else:
        make = point_grammar if kind == 2 else detect_grammar
        grammar = make(region_rows, 1 + i % 3)
        task = Task.POINT if kind == 2 else Task.DETECT
    req = GenerationRequest(
        task,
        image,
        request_id=f"r{i}",
        temperature=0.7 * (i % 2),
        seed=i,
        deadline=0.0 if i == 9 else None,
    )
    return Sequence(
        req,
        [BOS, *prompt] if image is None else prompt,
        grammar,
        PREFIX if image is not None else 0,
    )


def _cancelled(i: int) -> bool:
    return i % 6 == 4


@dataclass
class Run:
    depth: int
    device: FakeDevice
    rt: FakeRuntime
    sched: Scheduler
    seqs: dict[int, Sequence] = field(default_factory=dict)
    ends: dict[int, list[object]] = field(default_factory=dict)
    trace: list[tuple[str, Step]] = field(default_factory=list)
    max_refs: int = 0
    queued_at_commit: list[int] = field(default_factory=list)

    def answers(self) -> dict[int, tuple[object, ...]]:
        """Each request's end, comparable across runs (cancelled ones left out)."""
        out: dict[int, tuple[object, ...]] = {}
        for i, events in self.ends.items():
            if _cancelled(i):
                continue
            end = events[-1]
            if isinstance(end, EngineError):
                out[i] = ("error", end.code)
            else:
                assert isinstance(end, Finished)
                g = self.seqs[i].grammar
                tokens = tuple(g.token_ids) if isinstance(g, TextGrammar) else ()
                out[i] = (end.finish_reason, tokens, tuple(end.points), tuple(end.boxes))
        return out


def _drive(
    depth: int,
    seed: int,
    *,
    scheduler: type[Scheduler] = Scheduler,
    pipeline: type[PipelineState] | None = None,
    **faults: bool,
) -> Run:
    """Submit, cancel and tick by hand (no thread); between ticks the device runs a random
    number of operations, so launches overlap device work in many different ways."""
    rng = random.Random(1000 + seed)
    device = FakeDevice(seed)
    cfg = EngineConfig(
        max_batch=4,
        page_size=PAGE,
        pipeline_depth=depth,
        max_prefill_batch=3,
        prefix_cache_entries=2,
        mask_table_rows=64,
    )
    table = MaskTable(VOCAB, max_rows=64)
    region_rows = RegionRows.register(table, RegionTokens(EOS, COORD))
    rt = FakeRuntime(
        device,
        cfg,
        table,
        n_pages=30,
        max_context=MAX_CONTEXT,
        eos_id=EOS,
        coord_id=COORD,
        **faults,
    )
    sched = scheduler(rt, cfg, EOS, PREFIX)
    if pipeline is not None:
        sched.pipe = pipeline(depth)
    run = Run(depth, device, rt, sched)

    def trace(what: str, step: Step) -> None:
        run.trace.append((what, step))
        if what == "commit":
            run.queued_at_commit.append(device.queued)

    sched.trace = trace
    release = sched._release

    def checked_release(seq: Sequence) -> None:  # I6, seen from the scheduler
        held = [s for s in sched.pipe.slots if s is not None and seq in s.seqs]
        assert seq.finished and seq.inflight_refs == 0 and not held
        release(seq)

    sched._release = checked_release  # type: ignore[method-assign]
    burst = BURSTS[seed % len(BURSTS)]
    arrivals = {i: rng.randrange(60) for i in range(N_REQUESTS)}
    cancels = {i: arrivals[i] + rng.randrange(12) for i in arrivals if _cancelled(i)}
    for tick in range(5000):
        for i in (i for i, t in arrivals.items() if t == tick):
            seq = run.seqs[i] = _sequence(i, table, region_rows)
            run.ends[i] = []
            seq.emit = run.ends[i].append
            sched.waiting.append(seq)
        for i in (i for i, t in cancels.items() if t == tick):
            seq = run.seqs[i]
            if seq.cancelled is None and not seq.finished:
                seq.cancelled = ErrorCode.CANCELLED
        sched.tick()
        for seq in run.seqs.values():  # I4
            assert 0 <= seq.inflight_refs <= 2
            run.max_refs = max(run.max_refs, seq.inflight_refs)
        device.run(rng.randint(0, burst))
        if tick >= max(arrivals.values()) and not sched.has_work():
            break
    else:
        raise AssertionError("the workload did not finish")
    device.drain()
    return run


@pytest.fixture(scope="module")
def blocking_answers() -> dict[int, tuple[object, ...]]:
    return _drive(1, 0).answers()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth", [1, 2])
def test_scheduler_keeps_the_pipeline_invariants(
    depth: int, seed: int, blocking_answers: dict[int, tuple[object, ...]]
) -> None:
    run = _drive(depth, seed)
    s, device = run.sched, run.device
    for events in run.ends.values():  # every request ends exactly once
        assert sum(isinstance(e, Finished | EngineError) for e in events) == 1
        assert isinstance(events[-1], Finished | EngineError)
    assert run.answers() == blocking_answers  # same answers at any depth and interleaving
    kinds = {a[0] for a in blocking_answers.values()}
    assert {"eos", "length", "max_objects", "error"} <= kinds
    launched = [step.step_id for what, step in run.trace if what == "launch"]
    committed = [step for what, step in run.trace if what == "commit"]
    assert [step.step_id for step in committed] == launched  # I2: all of them, FIFO
    assert device.kernel_streams == ["compute"]  # I1
    # I7: exactly one host wait per committed step, on that step's D2H event.
    assert device.host_waits == [f"slot{step.slot}.d2h_done" for step in committed]
    if depth == 2:  # it really pipelined: a sequence in two steps, commits with work queued
        assert run.max_refs == 2 and max(run.queued_at_commit) > 0
    else:
        assert run.max_refs == 1
    assert not s.zombies and not s.running and not s.waiting
    assert all(x is None for x in s.pipe.slots) and len(s.free_rows) == s.cfg.max_rows
    s.prefix_cache.clear()
    assert run.rt.pages.used_pages == 0 and device.queued == 0


# ---- each fault is caught ------------------------------------------------------------------


class EagerReleaseScheduler(Scheduler):
    """Fault: frees a finished sequence's own pages at once, even while it is a zombie."""

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        if seq.inflight_refs and seq.own_pages:
            self.rt.pages.release(seq.own_pages)
            seq.own_pages = []


@pytest.mark.parametrize(
    ("depth", "fault", "invariant"),
    [
        (1, {"skip_d2h_wait": True}, "I7"),
        (2, {"skip_d2h_wait": True}, "I7"),
        (2, {"skip_step_done_wait": True}, "I3"),
        (2, {"skip_mask_wait": True}, "order"),
        (2, {"skip_inputs_wait": True}, "order"),
        (2, {"stream_per_slot": True}, "I1"),
        (2, {"pipeline": EarlySlotReusePipeline}, "I5"),
        (2, {"scheduler": EagerReleaseScheduler}, "I6"),
    ],
)
def test_faults_are_caught(depth: int, fault: dict[str, Any], invariant: str) -> None:
    with pytest.raises(DeviceViolation) as info:
        for seed in SEEDS:  # races are random: some seed must expose it
            _drive(depth, seed, **fault)
    assert info.value.invariant == invariant, info.value


# ---- the fake device itself ----------------------------------------------------------------


def test_event_semantics() -> None:
    """A wait holds its stream until the marker the event pointed at when the wait was issued
    executed; recording the event again later does not move that barrier; synchronize runs the
    device until the event completed and counts one host wait."""
    dev = FakeDevice(0)
    a, b = dev.stream("a"), dev.stream("b")
    ev = dev.event("ev")
    buf = dev.buffer("buf", [0])
    a.copy("write", lambda: buf.value.__setitem__(0, 1), [], [buf])
    ev.record(a)
    b.wait(ev)
    b.kernel("read", lambda: None, [buf], [])
    a.copy("later", lambda: None, [], [])
    ev.record(a)  # a second record: b's barrier still waits for the first marker only
    assert not b.runnable() and not ev.query()
    dev.run_stream(a, 2)
    assert b.runnable() and not ev.query()
    dev.run_stream(b, 2)
    assert buf.value == [1]
    ev.synchronize()
    assert ev.query() and dev.queued == 0 and dev.host_waits == ["ev"]


def test_device_detects_races() -> None:
    dev = FakeDevice(0)
    copy, compute = dev.stream("copy"), dev.stream("compute")
    out = dev.buffer("out", np.zeros(1), early_read="I3")
    landing = dev.buffer("landing", np.zeros(1), host=True, slot=0)
    compute.kernel("sample", lambda: None, [], [out])
    copy.copy("d2h", lambda: None, [out], [landing])  # no wait for the sample's event
    with pytest.raises(DeviceViolation) as info:
        dev.run_stream(copy)  # the copy runs first: it reads outputs not yet written
    assert info.value.invariant == "I3"

    dev = FakeDevice(0)
    copy = dev.stream("copy")
    pinned = dev.buffer("pinned", np.zeros(2), host=True, slot=1)
    landing = dev.buffer("landing", np.zeros(2), host=True, slot=1)
    dev.host_write(pinned, np.ones(2))
    copy.copy("h2d", lambda: None, [pinned], [])
    with pytest.raises(DeviceViolation) as info:  # the copy from it is still queued
        dev.host_write(pinned, np.zeros(2))
    assert info.value.invariant == "I5"
    copy.copy("d2h", lambda: None, [], [landing])
    with pytest.raises(DeviceViolation) as info:  # read without waiting for the copy
        dev.host_read(landing)
    assert info.value.invariant == "I7"
    dev.drain()
    assert dev.host_read(landing) is landing.value
    dev.stream("compute").kernel("k", lambda: None, [], [])
    with pytest.raises(DeviceViolation) as info:
        dev.stream("compute2").kernel("k", lambda: None, [], [])
    assert info.value.invariant == "I1"


# ---- the runtime protocol ------------------------------------------------------------------

_METHODS = ["launch_prefill", "launch_decode", "finalize", "read_outputs", "release_row"]


def test_protocol_is_what_the_scheduler_uses() -> None:
    src = inspect.getsource(scheduler_module)
    used = set(re.findall(r"self\.rt\.(\w+)", src)) | set(re.findall(r"runtime\.(\w+)", src))
    assert used == {"pages", *_METHODS}
    assert inspect.signature(Scheduler).parameters["runtime"].annotation == "Runtime"
    assert Runtime.__annotations__ == {"pages": "PageAllocator"}


@pytest.mark.parametrize("impl", [ModelRuntime, FakeRuntime])
def test_runtimes_match_the_protocol(impl: type) -> None:
    for name in _METHODS:
        assert inspect.signature(getattr(impl, name)) == inspect.signature(
            getattr(Runtime, name)
        ), f"{impl.__name__}.{name}"


def test_runtime_instances_satisfy_the_protocol(tiny: LoadedModel) -> None:
    cfg = EngineConfig(max_batch=2, kv_budget_bytes=1 << 20)
    real = ModelRuntime(tiny.model, cfg, MaskTable(tiny.model.config.text.vocab_size, 8))
    fake = FakeRuntime(
        FakeDevice(),
        cfg,
        MaskTable(VOCAB, 8),
        n_pages=8,
        max_context=MAX_CONTEXT,
        eos_id=EOS,
        coord_id=COORD,
    )
    for rt in (real, fake):
        assert isinstance(rt, Runtime) and isinstance(rt.pages, PageAllocator)
