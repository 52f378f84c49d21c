"""The production runtime and scheduler on a fake device (tests/support/fake_device.py) that
checks the pipeline invariants I1-I7 of docs/architecture.md under seeded random
interleavings.

`ModelRuntime` runs the tiny model on CPU tensors, but every copy, kernel, event record and
wait goes through the fake device, which executes them later, stream by stream, in a random
order that respects only the waits the runtime issued. Text, point and detect requests of
different lengths, image-prefix hits and misses, page pressure, cancellations and an expired
deadline run at depth 1 and 2 under a step budget so small that prompts are prefilled in chunks
over several mixed steps beside running decodes: nothing is flagged, and the answers equal
those of the blocking run and of a run whose prompts are never split. Then removing any
single event wait or record the runtime issues, the host's one wait, a slot reused before its
commit, zombie pages freed early and a second compute stream must each be caught.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.grammars import TextGrammar
from image_pipeline import PreparedImage, prepare_pil, sample_image
from tests.support.fake_device import (
    DeviceViolation,
    EarlySlotReusePipeline,
    FakeDevice,
    FakeTorchDevice,
)
from tests.support.threads import one_torch_thread  # noqa: F401  (autouse)
from vlm_server.engine.adapters import qualify_image
from vlm_server.engine.api import (
    BATCH_PRIORITY,
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core import admission as admission_module
from vlm_server.engine.core import scheduler as scheduler_module
from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.outputs import output_for
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.pipeline import LaunchKind, PipelineState, Step
from vlm_server.engine.core.prefix_jobs import PrefixJob
from vlm_server.engine.core.runtime_protocol import Runtime
from vlm_server.engine.core.scheduler import Scheduler
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.core.step_plan import Chunk, StepBudget
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.runtime import ModelRuntime
from vlm_server.engine.requests.tasks import TaskCompiler
from vlm_server.models.interface import LoadedModel

N_REQUESTS = 28
PAGE = 16  # an image prefix (730 positions) is not a page multiple: prefixes have a tail page
SEEDS = list(range(4))
# Device operations run between two ticks, drawn from 0..burst: from a device that runs only
# during host waits to one that is nearly synchronous.
BURSTS = [0, 3, 8, 40]
# Tokens per step: the four decode rows and at most three prompt tokens, so prompts are
# chunked over several mixed steps and image prefixes (730 positions) overdraw it alone.
SMALL_BUDGET = 7


@pytest.fixture(scope="module")
def images() -> list[PreparedImage]:
    base = sample_image()
    return [prepare_pil(base.resize((120, 90))), prepare_pil(base.resize((90, 160)))]


def _request(i: int, images: list[PreparedImage]) -> GenerationRequest:
    """Request i: a query without image (every other one reasoning), a caption, a point and
    a detect, in turn; some points and detects carry spatial references."""
    kind = i % 4
    image = images[i % len(images)] if kind else None
    task = [Task.QUERY, Task.CAPTION, Task.POINT, Task.DETECT][kind]
    refs = ((0.2, 0.3), (0.1, 0.1, 0.5, 0.6)) if kind >= 2 and i % 3 == 0 else ()
    return GenerationRequest(
        task,
        image,
        reasoning=kind == 0 and i % 8 == 0,
        spatial_refs=refs,
        request_id=f"r{i}",
        question=f"what is {i}?",
        object_name="dog" if i % 3 else "cat",
        temperature=0.7 * (i % 2),
        max_tokens=1 + (5 * i) % 9,
        max_objects=1 + i % 3,
        seed=i,
        deadline=0.0 if i == 9 else None,
    )


def _cancelled(i: int) -> bool:
    return i % 6 == 4


class _Watch(Observer):
    """Records the pipeline's steps and checks I6 (pages of in-flight steps stay allocated)."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.trace: list[tuple[str, Step]] = []
        self.queued_at_commit: list[int] = []
        self.in_flight: dict[int, set[int]] = {}
        self.chained = 0
        # Pages each image-prefix batch writes (its prompts' too), with its event's marker.
        self.prefix_writes: list[tuple[object, set[int]]] = []
        self.partitioned: list[bool] = []  # each batch: whether the scheduler asked for it
        self.interactive: list[bool] = []  # each batch: whether on the interactive lane

    def watch_prefixes(self, rt: ModelRuntime) -> None:
        """Note the pages of every prefix batch the runtime launches."""
        launch = rt.launch_prefixes

        def launch_prefixes(
            jobs: list[PrefixJob], partitioned: bool = False, interactive: bool = False
        ) -> object:
            handle = launch(jobs, partitioned, interactive)
            self.partitioned.append(partitioned)
            self.interactive.append(interactive)
            pages = {p for job in jobs for p in job.pages}
            pages |= {p for job in jobs if job.prompt is not None for p in job.prompt.pages}
            self.prefix_writes.append((handle.device_event()._marker, pages))  # type: ignore[attr-defined]
            return handle

        rt.launch_prefixes = launch_prefixes  # type: ignore[method-assign]

    def launched(self, step: Step) -> None:
        self.trace.append(("launch", step))
        if step.plan is not None:  # held rows launched before the host saw their prefix
            rows = zip(step.seqs[step.plan.n_decode :], step.plan.chunks, strict=True)
            self.chained += sum(not c.length and not s.prefix.ready for s, c in rows)
        pages: set[int] = set()
        for seq in step.seqs:
            pages.update(seq.own_pages)
            if seq.prefix is not None:
                pages.update(seq.prefix.pages)
        self.in_flight[step.step_id] = pages

    def committed(self, step: Step) -> None:
        # The host waits for this step's results next; only then are its pages released.
        self.trace.append(("commit", step))
        self.queued_at_commit.append(self.device.queued)
        self.in_flight.pop(step.step_id, None)

    def finalized(self, step: Step) -> None:
        self.trace.append(("finalize", step))

    def check_free(self, pages: list[int], allocator: PageAllocator) -> None:
        freed = {p for p in pages if allocator.refcount[p] == 0}
        # A batch whose event was never recorded counts as done, as its event query says.
        writing = [pages for marker, pages in self.prefix_writes if not getattr(marker, "done", 1)]
        busy = freed & set().union(*self.in_flight.values(), *writing)
        if busy:
            raise DeviceViolation(
                "I6", f"pages {sorted(busy)} freed while a step in flight still uses them"
            )


class _CheckedPages(PageAllocator):
    """The page allocator, asking the watcher about every page whose last reference went."""

    watch: _Watch

    def release(self, pages: list[int]) -> None:
        super().release(pages)
        self.watch.check_free(pages, self)


@dataclass
class Run:
    depth: int
    device: FakeTorchDevice
    sched: Scheduler
    watch: _Watch
    seqs: dict[int, Sequence] = field(default_factory=dict)
    ends: dict[int, list[object]] = field(default_factory=dict)
    max_refs: int = 0

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
    loaded: LoadedModel,
    images: list[PreparedImage],
    depth: int,
    seed: int,
    *,
    scheduler: type[Scheduler] = Scheduler,
    pipeline: type[PipelineState] | None = None,
    budget: int = SMALL_BUDGET,
    n_requests: int = N_REQUESTS,
    riding: int = EngineConfig().prefix_prompt_tokens,
    when_streaming: int = 0,
    adapters: int = 0,
    background: bool = False,
    kv_dtype: str = "auto",
    **faults: object,
) -> Run:
    """Submit, cancel and tick by hand (no thread); between ticks the device runs a random
    number of operations, so launches overlap device work in many different ways."""
    rng = random.Random(1000 + seed)
    device = FakeTorchDevice(seed, prefill_lanes=when_streaming > 0, **faults)  # type: ignore[arg-type]
    cfg = EngineConfig(
        # Two prefill lanes: a partition (its size matters only on CUDA) used while streaming.
        prefill_sms=8 if when_streaming else 0,
        prefill_sms_when_streaming=when_streaming,
        max_batch_size=4,
        page_size=PAGE,
        pipeline_depth=depth,
        max_prefill_batch=3,
        max_step_tokens=budget,
        prefix_prompt_tokens=riding,
        prefix_cache_entries=1,
        mask_table_rows=64,
        # Room for a few requests at a time: admission waits for pages to come back.
        kv_budget_bytes=_kv_bytes(loaded, pages=150, kv_dtype=kv_dtype),
        kv_dtype=kv_dtype,
        # Adapters (tests/test_adapters_engine.py): request i uses slot i % (adapters + 1) - 1.
        adapters_dir="." if adapters else None,
        max_adapters=max(adapters, 1),
        max_adapter_rank=4,
        # Background work (two requests in three) holds at most three rows.
        background_reserved_rows=1,
    )
    tasks = TaskCompiler(loaded.config, loaded.tokenizer, cfg.mask_table_rows)
    watch = _Watch(device)
    rt = ModelRuntime(loaded.model, cfg, tasks.table, device=device, observer=watch)
    if adapters:
        _fill_adapter_slots(rt)
    checked = _CheckedPages(
        rt.kv_pages,
        cfg.page_size,
        cfg.max_rows,
        rt.block_table.shape[1],
        block_table=rt.block_table,
    )
    checked.watch = watch
    watch.watch_prefixes(rt)
    pipe = pipeline(depth) if pipeline is not None else None
    sched = scheduler(
        rt,
        cfg,
        loaded.config.tokens.eos_id,
        loaded.config.image_prefix_len,
        watch,
        pipe,
        pages=checked,
    )
    run = Run(depth, device, sched, watch)
    burst = BURSTS[seed % len(BURSTS)]
    arrivals = {i: rng.randrange(40) for i in range(n_requests)}
    cancels = {i: arrivals[i] + rng.randrange(12) for i in arrivals if _cancelled(i)}
    with torch.inference_mode():
        for tick in range(4000):
            for i in (i for i, t in arrivals.items() if t == tick):
                req, slot = _request(i, images), i % (adapters + 1) - 1 if adapters else -1
                if slot >= 0:  # its image prefix is the adapter's own (engine/adapters.py)
                    req = qualify_image(dataclasses.replace(req, adapter=f"s{slot}"))
                if background and i % 3:
                    req = dataclasses.replace(req, priority=BATCH_PRIORITY)
                built = tasks.build(req)
                seq = Sequence(
                    req, built.prompt, built.grammar, built.prefix_len, ref_values=built.ref_values
                )
                seq.output = output_for(built.grammar, tasks.vocab)
                seq.adapter_slot = slot
                run.seqs[i], run.ends[i] = seq, []
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
            if not burst and sched.stalled_on_prefixes():
                # A device that runs only during host waits: the engine's prefix watcher
                # waits for the prefix that everything else waits on.
                device.run(8)
            if tick >= max(arrivals.values()) and not sched.has_work():
                break
        else:
            raise AssertionError("the workload did not finish")
        device.drain()
    return run


def _fill_adapter_slots(rt: ModelRuntime) -> None:
    """Seeded random adapters in every slot of the runtime's bank (as a load leaves them)."""
    from vlm_server.models.lora.files import rename, validate
    from vlm_server.models.lora.writer import random_state

    bank = rt.adapter_bank
    assert bank is not None
    for slot in range(bank.n_slots):
        state = random_state(bank.targets, 4 - slot % 2, seed=slot, scale=0.3)
        weights = validate({rename(k): v for k, v in state.items()}, bank.targets, 4, "x")
        bank.write(slot, bank.staging(weights), weights.rank)


def _kv_bytes(loaded: LoadedModel, pages: int, kv_dtype: str = "auto") -> int:
    """The budget of ``pages`` pages in ``kv_dtype``'s format: the same page pressure in
    every format."""
    return pages * ModelEntryPoints(loaded.model).kv_page_bytes(PAGE, kv_dtype)


@pytest.fixture(scope="module")
def blocking(region_model: LoadedModel, images: list[PreparedImage]) -> Run:
    return _drive(region_model, images, 1, 0)


def test_chunked_prefill_answers_equal_unchunked_ones(
    region_model: LoadedModel, images: list[PreparedImage], blocking: Run
) -> None:
    """The same workload with a budget that never splits a prompt answers the same."""
    whole = _drive(region_model, images, 1, 0, budget=EngineConfig().max_step_tokens)
    assert whole.answers() == blocking.answers()
    chunked = [s for what, s in blocking.watch.trace if what == "launch" and s.plan]
    assert all(s.plan.n_tokens <= SMALL_BUDGET for s in chunked)
    assert any(not c.final for s in chunked for c in s.plan.chunks)  # prompts were split
    assert any(s.plan.n_decode for s in chunked)  # and shared steps with decode rows
    # Steps without prefill work stay decode-only (the graphed path on CUDA).
    kinds = {s.kind for what, s in blocking.watch.trace if what == "launch"}
    assert kinds == {LaunchKind.MIXED, LaunchKind.DECODE}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth", [1, 2])
def test_the_production_runtime_keeps_the_pipeline_invariants(
    region_model: LoadedModel, images: list[PreparedImage], depth: int, seed: int, blocking: Run
) -> None:
    run = _drive(region_model, images, depth, seed)
    s, device, watch = run.sched, run.device, run.watch
    for events in run.ends.values():  # every request ends exactly once
        assert sum(isinstance(e, Finished | EngineError) for e in events) == 1
        assert isinstance(events[-1], Finished | EngineError)
    expected = blocking.answers()
    assert run.answers() == expected  # same answers at any depth and interleaving
    kinds = {a[0] for a in expected.values()}
    assert {"eos", "length", "max_objects", "error"} <= kinds, kinds
    launched = [step.step_id for what, step in watch.trace if what == "launch"]
    committed = [step for what, step in watch.trace if what == "commit"]
    assert [step.step_id for step in committed] == launched  # I2: all of them, FIFO
    assert device.kernel_streams == ["compute"]  # I1
    # I7: exactly one host wait per committed step, on that step's D2H event.
    assert device.host_waits == [f"slot{step.slot}.d2h_done" for step in committed]
    if depth == 2:  # it really pipelined: a sequence in two steps, commits with work queued
        assert run.max_refs == 2 and max(watch.queued_at_commit) > 0
    else:
        assert run.max_refs == 1
    assert not s.zombies and not s.running and not s.waiting
    assert all(x is None for x in s.pipe.slots) and len(s.free_rows) == s.cfg.max_rows
    s.prefix_cache.clear()
    assert s.pages.used_pages == 0 and device.queued == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_compact_kv_pages_keep_the_invariants_and_free_every_page(
    region_model: LoadedModel, images: list[PreparedImage], kv_dtype: str
) -> None:
    """With compact KV pages (--kv-dtype): the same invariants, cancels and zombies free
    every page, and a pipelined random interleaving answers as the blocking run in the same
    format (prefix pages copied with their scales, or answers would differ)."""
    blocking = _drive(region_model, images, 1, 0, kv_dtype=kv_dtype)
    run = _drive(region_model, images, 2, 1, kv_dtype=kv_dtype)
    runtime = run.sched.rt
    assert isinstance(runtime, ModelRuntime)
    assert runtime.pool.kv.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
    assert runtime.pool.kv_scales is not None and runtime.pool.kv_scales.any()
    assert run.answers() == blocking.answers()
    launched = [step.step_id for what, step in run.watch.trace if what == "launch"]
    assert [step.step_id for what, step in run.watch.trace if what == "commit"] == launched
    assert run.max_refs == 2
    s = run.sched
    assert not s.zombies and not s.running and not s.waiting
    s.prefix_cache.clear()
    assert s.pages.used_pages == 0 and run.device.queued == 0


def _decode_behind_lone_prompt_end(trace: list[tuple[str, Step]]) -> bool:
    """Whether a step launched into an empty pipeline ended a prompt, and that sequence's
    first decode row launched before the step was committed."""
    uncommitted: set[int] = set()
    ending: dict[int, set[int]] = {}  # lone uncommitted step -> sequences whose prompt it ends
    for what, step in trace:
        if what == "commit":
            uncommitted.discard(step.step_id)
            ending.pop(step.step_id, None)
        if what != "launch":
            continue
        plan = step.plan
        n_decode = len(step.seqs) if plan is None else plan.n_decode
        waiting = set().union(*ending.values()) if ending else set()
        if any(id(seq) in waiting for seq in step.seqs[:n_decode]):
            return True
        if plan is not None and not uncommitted:
            rows = range(n_decode, len(step.seqs))
            ending[step.step_id] = {id(step.seqs[i]) for i in rows if plan.ends_prefill(i)}
        uncommitted.add(step.step_id)
    return False


@pytest.mark.parametrize("seed", SEEDS)
def test_a_lone_step_ending_a_prompt_is_sampled_before_the_next_launch(
    region_model: LoadedModel, images: list[PreparedImage], seed: int
) -> None:
    """One request alone: its prompt's step has nothing older to commit, so it is sampled
    at once and the first decode row launches behind it, not after its commit (a host round
    trip per request at low load)."""
    whole = EngineConfig().max_step_tokens
    run = _drive(region_model, images, 2, seed, budget=whole, n_requests=1)
    assert _decode_behind_lone_prompt_end(run.watch.trace)


class _PendingWatch(Scheduler):
    """Counts the ticks that launched a step while some image prefix was still pending."""

    waited = 0

    def _launch(self) -> None:
        if self.pending_prefixes and self.running:
            self.waited += 1
        super()._launch()


@pytest.mark.parametrize("depth", [1, 2])
def test_a_slow_prefill_stream_changes_no_answer(
    region_model: LoadedModel, images: list[PreparedImage], depth: int, blocking: Run
) -> None:
    """Image prefixes that finish only when nothing else can run (their requests wait as
    pending, requests for the same image join them): same answers, same invariants. No
    prompt rides its prefix here: a request alone would chain its held row behind it."""
    run = _drive(
        region_model, images, depth, 1, scheduler=_PendingWatch, lagging=["prefill"], riding=0
    )
    assert run.answers() == blocking.answers()
    assert isinstance(run.sched, _PendingWatch) and run.sched.waited > 0  # they really waited
    assert run.device.kernel_streams == ["compute"]
    assert not run.sched.pending_prefixes and not run.sched.running
    run.sched.prefix_cache.clear()
    assert run.sched.pages.used_pages == 0 and run.device.queued == 0


@pytest.fixture(scope="module")
def many_images() -> list[PreparedImage]:
    """Six pictures: with one cached prefix, most requests bring a new image batch."""
    base = sample_image()
    return [prepare_pil(base.resize((100 + 12 * k, 90 + 7 * k))) for k in range(6)]


@pytest.fixture(scope="module")
def one_lane(region_model: LoadedModel, many_images: list[PreparedImage]) -> Run:
    return _drive(region_model, many_images, 1, 0)


def _assert_drained(run: Run) -> None:
    """Every kernel ran on the compute stream, and the run left nothing behind: no sequence,
    no page (once the prefix cache is emptied), no queued device work."""
    assert run.device.kernel_streams == ["compute"]
    assert not run.sched.zombies and not run.sched.running and not run.sched.waiting
    run.sched.prefix_cache.clear()
    assert run.sched.pages.used_pages == 0 and run.device.queued == 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth", [1, 2])
def test_two_prefill_lanes_keep_the_invariants_and_the_answers(
    region_model: LoadedModel,
    many_images: list[PreparedImage],
    depth: int,
    seed: int,
    one_lane: Run,
) -> None:
    """A partition used only while requests stream (``prefill_sms_when_streaming``): batches
    of new images go to either prefill stream as the running requests' remaining tokens say,
    and a batch on one lane waits for the other lane's last one (they share static buffers).
    Odd seeds make the partitioned lane the slow one."""
    lagging = ["prefill_part"] if seed % 2 else []
    riding = 0 if lagging else EngineConfig().prefix_prompt_tokens
    run = _drive(
        region_model, many_images, depth, seed, when_streaming=3, lagging=lagging, riding=riding
    )
    assert run.answers() == one_lane.answers()
    assert set(run.watch.partitioned) == {False, True}  # both lanes served batches
    streams = {stream for stream, name in run.device.records_seen if name == "prefix_done"}
    assert streams == {"prefill", "prefill_part"}
    assert any(name == "lane_done" for _, name in run.device.waits_seen)  # lanes switched
    _assert_drained(run)


@pytest.mark.parametrize("seed", SEEDS[:2])  # a fast lane and a slow one
@pytest.mark.parametrize("depth", [1, 2])
def test_the_interactive_lane_keeps_the_invariants_and_the_answers(
    region_model: LoadedModel,
    many_images: list[PreparedImage],
    depth: int,
    seed: int,
    one_lane: Run,
) -> None:
    """Background work beside interactive requests: interactive pictures take the lane with
    buffers and graphs of its own, beside batches on the prefill stream, and their riders are
    sampled by steps that wait for the lane on the device. Odd seeds make the lane slow."""
    lagging = ["prefill_interactive"] if seed % 2 else []
    run = _drive(region_model, many_images, depth, seed, background=True, lagging=lagging)
    assert run.answers() == one_lane.answers()
    assert set(run.watch.interactive) == {False, True}  # both lanes served batches
    streams = {stream for stream, name in run.device.records_seen if name == "prefix_done"}
    assert streams == {"prefill", "prefill_interactive"}
    _assert_drained(run)


def test_a_step_not_waiting_for_the_lane_is_caught(
    region_model: LoadedModel, many_images: list[PreparedImage]
) -> None:
    """Drop the steps' waits for prefix batches: with the lane slow, a chained step reads a
    rider's pages before the lane wrote them."""
    _assert_caught(
        region_model,
        many_images,
        background=True,
        drop_waits=["prefix_done"],
        lagging=["prefill_interactive"],
    )


def _assert_caught(loaded: LoadedModel, images: list[PreparedImage], **faults: object) -> None:
    """Some seed's run with ``faults`` breaks the order of device work, and it is caught."""
    with pytest.raises(DeviceViolation) as info:
        for seed in SEEDS:
            _drive(loaded, images, 2, seed, **faults)  # type: ignore[arg-type]
    assert info.value.invariant == "order", info.value


def test_a_lane_switch_without_its_wait_is_caught(
    region_model: LoadedModel, many_images: list[PreparedImage]
) -> None:
    """Drop the wait for the other lane's last batch: with that lane slow, a batch overwrites
    the shared prefix embeddings before the earlier batch on the other lane read them."""
    _assert_caught(
        region_model,
        many_images,
        when_streaming=3,
        riding=0,
        drop_waits=["lane_done"],
        lagging=["prefill_part"],
    )


def test_the_policy_follows_the_running_requests_remaining_tokens(
    region_model: LoadedModel, many_images: list[PreparedImage], one_lane: Run
) -> None:
    """Always partitioned without a threshold; with one, only while something streams."""
    run = _drive(region_model, many_images, 2, 0, when_streaming=100)  # nothing that long
    assert run.watch.partitioned and not any(run.watch.partitioned)
    assert run.answers() == one_lane.answers()
    assert one_lane.watch.partitioned and all(one_lane.watch.partitioned)  # one lane: always


class _CancelRiders(Scheduler):
    """A client that cancels every request whose prompt rides its image prefix, at once."""

    riders: list[str]

    def _admit(
        self, budget: StepBudget, interactive_only: bool = False
    ) -> list[tuple[Sequence, Chunk]]:
        admitted = super()._admit(budget, interactive_only)
        for seq in self.running:
            if seq.rides_prefix and seq.cancelled is None:
                self.riders.append(seq.request.request_id)
                seq.cancelled = ErrorCode.CANCELLED
        return admitted


@pytest.mark.parametrize("depth", [1, 2])
def test_a_prompt_cancelled_while_riding_its_prefix_waits_for_the_batch(
    region_model: LoadedModel, images: list[PreparedImage], depth: int
) -> None:
    """Cancelled while its image prefix batch (which writes its pages) is on the device: it
    ends cancelled, and its pages are freed only once the batch completed (the watcher's I6
    check covers the prefill stream's writes)."""
    _CancelRiders.riders = []
    run = _drive(region_model, images, depth, 1, scheduler=_CancelRiders, lagging=["prefill"])
    assert _CancelRiders.riders
    for i, seq in run.seqs.items():
        if seq.request.request_id in _CancelRiders.riders:
            end = run.ends[i][-1]
            assert isinstance(end, EngineError) and end.code is ErrorCode.CANCELLED
    assert not run.sched.running and not run.sched.zombies
    run.sched.prefix_cache.clear()
    assert run.sched.pages.used_pages == 0 and run.device.queued == 0


# ---- each fault is caught ------------------------------------------------------------------


class EagerRidingCancelScheduler(Scheduler):
    """Fault: a prompt riding its image prefix, cancelled by its client right after admission,
    lets go of its reference at once, so its pages are freed while the prefill stream may
    still write them."""

    def _sweep_cancelled(self) -> None:
        for seq in self.running:
            if seq.rides_prefix:
                seq.cancelled = ErrorCode.CANCELLED
                seq.rides_prefix = False
                seq.drop_ref()
        super()._sweep_cancelled()


class EagerReleaseScheduler(Scheduler):
    """Fault: frees a finished sequence's own pages at once, even while it is a zombie."""

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        if seq.inflight_refs and seq.own_pages:
            self.pages.release(seq.own_pages)
            seq.own_pages = []


def _sync_points(blocking: Run) -> tuple[list[str], list[str]]:
    """Every event the production runtime waits on and records (by name, slots merged)."""
    waits = sorted({name for _, name in blocking.device.waits_seen})
    records = sorted({name for stream, name in blocking.device.records_seen if stream != "host"})
    return waits, records


def test_held_rows_of_a_request_alone_chain_behind_its_prefix(blocking: Run) -> None:
    """Prompts riding their image prefix while nothing else ran were sampled by a step
    queued behind the prefix on the device (the answers are checked against other depths
    and budgets above), and their prefix wait was still measured."""
    assert blocking.watch.chained
    riders = [s for s in blocking.seqs.values() if s.prefix is not None and not s.prefix_hit]
    assert all(s.metrics.prefix_wait_ms > 0 for s in riders if not s.cancelled)


def test_the_runtime_issues_the_expected_waits_and_records(blocking: Run) -> None:
    waits, records = _sync_points(blocking)
    # prefix_done: polled by the scheduler before any step reads a new image prefix's pages,
    # waited for on the device only by held rows chained behind their prefixes.
    assert waits == ["inputs_ready", "mask_ready", "prefix_done", "step_done"]
    assert records == ["d2h_done", "inputs_ready", "mask_ready", "prefix_done", "step_done"]


@pytest.mark.parametrize(
    ("fault", "invariant"),
    [
        ({"drop_waits": ["inputs_ready"]}, "order"),
        ({"drop_waits": ["mask_ready"]}, "order"),
        ({"drop_waits": ["step_done"]}, "I3"),
        # A held row chained behind its prefix would read the held state before it is written.
        ({"drop_waits": ["prefix_done"], "lagging": ["prefill"]}, "order"),
        ({"drop_records": ["inputs_ready"]}, "order"),
        ({"drop_records": ["mask_ready"]}, "order"),
        ({"drop_records": ["step_done"]}, "I3"),
        ({"drop_records": ["d2h_done"]}, "I7"),
        # A slow prefill stream: steps would read a new prefix's pages before they are written.
        ({"drop_records": ["prefix_done"], "lagging": ["prefill"]}, "order"),
        ({"skip_host_wait": True}, "I7"),
        ({"split_compute": True}, "I1"),
        ({"pipeline": EarlySlotReusePipeline}, "I5"),
        ({"scheduler": EagerReleaseScheduler}, "I6"),
        ({"scheduler": EagerRidingCancelScheduler, "lagging": ["prefill"]}, "I6"),
    ],
)
def test_each_fault_is_caught(
    region_model: LoadedModel,
    images: list[PreparedImage],
    fault: dict[str, object],
    invariant: str,
    blocking: Run,
) -> None:
    waits, records = _sync_points(blocking)
    for name in fault.get("drop_waits", []):  # type: ignore[attr-defined]
        assert name in waits
    for name in fault.get("drop_records", []):  # type: ignore[attr-defined]
        assert name in records
    with pytest.raises(DeviceViolation) as info:
        for seed in SEEDS:  # races are random: some seed must expose it
            _drive(region_model, images, 2, seed, **fault)  # type: ignore[arg-type]
    assert info.value.invariant == invariant, info.value


def test_every_wait_and_record_of_the_runtime_is_covered_by_a_fault_test(blocking: Run) -> None:
    """Removing any single wait or record must be among the faults above."""
    waits, records = _sync_points(blocking)
    params = Path(__file__).read_text()
    for name in waits:
        assert f'"drop_waits": ["{name}"]' in params, name
    for name in records:
        assert f'"drop_records": ["{name}"]' in params, name


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


def test_row_regions_are_versioned_per_row() -> None:
    """A copy into some rows of a buffer does not race a queued read of other rows."""
    dev = FakeTorchDevice(0)
    table = dev.buffer("table", torch.zeros(4, 2))
    dev.kernel(dev.compute_stream, "read row 0", lambda: None, lambda: ([(table, [0])], []))
    dev.copy(dev.copy_stream, "write row 1", lambda: None, lambda: ([], [(table, [1])]))
    dev.run_stream(dev.copy_stream)  # fine: row 0's reader is not affected
    dev.copy(dev.copy_stream, "write row 0", lambda: None, lambda: ([], [(table, [0])]))
    with pytest.raises(DeviceViolation):
        dev.run_stream(dev.copy_stream)  # row 0 still has a queued reader


# ---- the runtime protocol ------------------------------------------------------------------

_METHODS = [
    "launch_prefixes",
    "prefix_ready",
    "launch_mixed",
    "launch_decode",
    "finalize",
    "read_outputs",
]


def test_protocol_is_what_the_scheduler_uses() -> None:
    src = inspect.getsource(scheduler_module) + inspect.getsource(admission_module)
    used = set(re.findall(r"self\.rt\.(\w+)", src)) | set(re.findall(r"runtime\.(\w+)", src))
    attrs = {
        "kv_pages": "int",
        "block_table": "np.ndarray",
        "prefix_slots": "int",
        "prefix_prompt_tokens": "int",
        "interactive_prefix_slots": "int",
        "interactive_prefill_batch": "int",
    }
    assert used == {*attrs, *_METHODS}
    assert inspect.signature(Scheduler).parameters["runtime"].annotation == "Runtime"
    assert Runtime.__annotations__ == attrs


def test_the_runtime_matches_the_protocol(tiny: LoadedModel) -> None:
    for name in _METHODS:
        assert inspect.signature(getattr(ModelRuntime, name)) == inspect.signature(
            getattr(Runtime, name)
        ), name
    cfg = EngineConfig(max_batch_size=2, kv_budget_bytes=1 << 20)
    table = TaskCompiler(tiny.config, tiny.tokenizer, 64).table
    for device in (None, FakeTorchDevice()):
        rt = ModelRuntime(tiny.model, cfg, table, device=device)
        assert isinstance(rt, Runtime) and isinstance(rt.block_table, np.ndarray)
        # What the scheduler's page allocator is built from.
        PageAllocator(
            rt.kv_pages,
            cfg.page_size,
            cfg.max_rows,
            rt.block_table.shape[1],
            block_table=rt.block_table,
        )
