"""A fake device that runs the real scheduler and checks the pipeline invariants of DESIGN.md.

`FakeDevice` keeps what matters for ordering on a GPU: named streams, each a FIFO of
operations; events whose `record` enqueues a marker (the event completes once the device has
executed everything before the marker on that stream); `FakeStream.wait`, a barrier holding
the stream until the marker the event pointed at when the wait was issued has executed; and
`FakeEvent.synchronize`, the host wait, which runs the device until the event completed.
Nothing executes unless a test calls `FakeDevice.run` or the host waits, and then in a seeded
random interleaving of the streams, so a missing wait turns into an observable race.

Every buffer keeps versions: how many writes were issued (program order) and which one its
memory holds now. A read is issued against the version current at issue time, so executing it
checks that exactly that write landed and nothing overwrote it yet; a write checks that no
issued read of the previous contents is still queued. Any violation raises `DeviceViolation`
naming the invariant at stake.

`FakeRuntime` implements the runtime protocol on the fake device with the operation sequence
of `ModelRuntime` and a deterministic stand-in model, so the real scheduler and the real
grammars run end to end. Its fault switches each remove one wait, or give every slot its own
compute stream; `EarlySlotReusePipeline` hands a slot out again before its commit.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from decoding.mask_table import NO_MASK, MaskTable
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.pages import SINK_PAGE, PageAllocator
from vlm_server.engine.pipeline_state import PipelineError, PipelineState, SlotState, Step
from vlm_server.engine.runtime import F_MASK, F_PHASE, F_ROW, F_TEMP, N_FIN, N_OUT
from vlm_server.engine.sequence import (
    PHASE_BOUNDARY,
    PHASE_COORD,
    PHASE_SIZE,
    PHASE_TOKEN,
    Sequence,
)

if TYPE_CHECKING:
    import torch


class DeviceViolation(AssertionError):
    """An ordering bug caught by the fake device. ``invariant`` is the DESIGN.md invariant
    (I1..I7) it breaks, "order" for a missing wait on any other buffer, or "data" for a
    runtime call whose arguments contradict what was launched."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


# ---- the device ---------------------------------------------------------------------------


@dataclass(eq=False)
class FakeBuffer:
    """Device memory or pinned host memory, with its version record."""

    name: str
    value: Any
    host: bool = False  # pinned host memory: the host reads and writes it directly
    slot: int | None = None  # owning pipeline slot: a reuse race there breaks I5
    early_read: str = "order"  # the invariant a read before its producer breaks
    issued: int = 0  # writes issued so far, in program order
    held: int = 0  # the issued write whose data the memory holds now
    pending: Counter[int] = field(default_factory=Counter)  # queued reads, per version

    @property
    def race(self) -> str:
        return "I5" if self.slot is not None else "order"


@dataclass(eq=False)
class _Marker:
    event: str
    done: bool = False


@dataclass(eq=False)
class _Op:
    name: str
    stream: FakeStream
    fn: Callable[[], None] | None = None
    reads: list[tuple[FakeBuffer, int]] = field(default_factory=list)
    writes: list[tuple[FakeBuffer, int]] = field(default_factory=list)
    record: _Marker | None = None  # an event record: completes this marker
    wait: _Marker | None = None  # a barrier: runs only once this marker completed


class FakeEvent:
    """An event with CUDA semantics: it stands for the work issued before its last record."""

    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device = device
        self.name = name
        self._marker: _Marker | None = None

    def record(self, stream: FakeStream) -> None:
        marker = _Marker(self.name)
        stream._push(_Op(f"record {self.name}", stream, record=marker))
        self._marker = marker

    def query(self) -> bool:
        """Complete (a never-recorded event counts as complete, as on CUDA)."""
        return self._marker is None or self._marker.done

    def synchronize(self) -> None:
        """The host waits: the device runs (randomly interleaved) until the event completed."""
        self.device.host_waits.append(self.name)
        self.device._run_until(self.query, self.name)


class FakeStream:
    """A FIFO of operations; only its head can execute."""

    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.queue: deque[_Op] = deque()

    def wait(self, event: FakeEvent) -> None:
        """Later work on this stream runs only after the event's current marker executed."""
        if event._marker is not None:
            self._push(_Op(f"wait {event.name}", self, wait=event._marker))

    def copy(
        self,
        name: str,
        fn: Callable[[], None],
        reads: Iterable[FakeBuffer],
        writes: Iterable[FakeBuffer],
    ) -> None:
        """Enqueue a memory copy."""
        self._enqueue(name, fn, reads, writes)

    def kernel(
        self,
        name: str,
        fn: Callable[[], None],
        reads: Iterable[FakeBuffer],
        writes: Iterable[FakeBuffer],
    ) -> None:
        """Enqueue a compute kernel (forward, sampling): only one stream may run kernels."""
        self.device._kernel_on(self)
        self._enqueue(name, fn, reads, writes)

    def runnable(self) -> bool:
        if not self.queue:
            return False
        wait = self.queue[0].wait
        return wait is None or wait.done

    def _enqueue(
        self,
        name: str,
        fn: Callable[[], None],
        reads: Iterable[FakeBuffer],
        writes: Iterable[FakeBuffer],
    ) -> None:
        op = _Op(name, self, fn)
        for buf in reads:
            op.reads.append((buf, buf.issued))
            buf.pending[buf.issued] += 1
        for buf in writes:
            buf.issued += 1
            op.writes.append((buf, buf.issued))
        self._push(op)

    def _push(self, op: _Op) -> None:
        self.queue.append(op)


class FakeDevice:
    """Streams, events and versioned buffers; executes only when told to, in a seeded random
    interleaving that respects each stream's order and its barriers."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.streams: dict[str, FakeStream] = {}
        self.host_waits: list[str] = []  # the event each host wait was for, in order
        self.kernel_streams: list[str] = []  # streams that ran kernels (I1: exactly one)
        self.executed = 0
        # Host writes into a buffer while a copy from it was queued, harmless only because no
        # queued step reads the changed part (see FakeRuntime._copy_blocks).
        self.notes: list[str] = []

    def stream(self, name: str) -> FakeStream:
        if name in self.streams:
            raise ValueError(f"stream {name} exists")
        self.streams[name] = FakeStream(self, name)
        return self.streams[name]

    def event(self, name: str) -> FakeEvent:
        return FakeEvent(self, name)

    def buffer(
        self,
        name: str,
        value: Any,
        *,
        host: bool = False,
        slot: int | None = None,
        early_read: str = "order",
    ) -> FakeBuffer:
        return FakeBuffer(name, value, host=host, slot=slot, early_read=early_read)

    @property
    def queued(self) -> int:
        return sum(len(s.queue) for s in self.streams.values())

    # ---- execution ----------------------------------------------------------------------

    def run(self, n: int) -> int:
        """Execute up to ``n`` operations; returns how many ran (fewer once idle)."""
        for i in range(n):
            if not self._step(self._ready()):
                return i
        return n

    def run_stream(self, stream: FakeStream, n: int = 1) -> None:
        """Execute the next ``n`` operations of one stream (tests force an order with it)."""
        for _ in range(n):
            if not stream.runnable():
                raise RuntimeError(f"stream {stream.name} cannot run now")
            self._step([stream])

    def drain(self) -> None:
        """Execute everything queued (not a host wait: tests call it between ticks)."""
        self._run_until(lambda: self.queued == 0, "all queued work")

    def synchronize(self) -> None:
        """A host wait for the whole device; the pipeline never needs one (I7 counts it)."""
        self.host_waits.append("device")
        self.drain()

    def _ready(self) -> list[FakeStream]:
        return [s for s in self.streams.values() if s.runnable()]

    def _run_until(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            if not self._step(self._ready()):
                raise DeviceViolation(
                    "order", f"waiting for {what}, which nothing queued can complete"
                )

    def _step(self, ready: list[FakeStream]) -> bool:
        if not ready:
            if self.queued:
                heads = {s.name: s.queue[0].name for s in self.streams.values() if s.queue}
                raise DeviceViolation("order", f"deadlock: every stream waits ({heads})")
            return False
        stream = self.rng.choice(ready)
        self._execute(stream.queue.popleft())
        return True

    def _execute(self, op: _Op) -> None:
        where = f"{op.name!r} on stream {op.stream.name!r}"
        for buf, v in op.reads:
            if buf.held < v:
                raise DeviceViolation(
                    buf.early_read,
                    f"{where} read {buf.name} before the write "
                    f"it depends on executed (holds v{buf.held}, needs v{v}): "
                    "a missing event wait",
                )
            if buf.held > v:
                raise DeviceViolation(
                    buf.race,
                    f"{where} read {buf.name} after a later write "
                    f"replaced it (holds v{buf.held}, needs v{v})",
                )
        own = Counter(op.reads)
        for buf, v in op.writes:
            if buf.held != v - 1:
                raise DeviceViolation(
                    buf.race,
                    f"{where} wrote {buf.name} v{v} while it holds "
                    f"v{buf.held}: two writes ran out of order",
                )
            others = buf.pending[v - 1] - own[(buf, v - 1)]
            if others:
                raise DeviceViolation(
                    buf.race,
                    f"{where} overwrote {buf.name} while {others} "
                    "queued read(s) of its previous contents had not run",
                )
        if op.record is not None:
            op.record.done = True
        if op.fn is not None:
            op.fn()
        for buf, v in op.reads:
            buf.pending[v] -= 1
        for buf, v in op.writes:
            buf.held = v
        self.executed += 1

    def _kernel_on(self, stream: FakeStream) -> None:
        if stream.name not in self.kernel_streams:
            self.kernel_streams.append(stream.name)
        if len(self.kernel_streams) > 1:
            raise DeviceViolation(
                "I1",
                f"kernels on streams {self.kernel_streams}: all forwards "
                "and sampling must share one compute stream",
            )

    # ---- host access to pinned memory ---------------------------------------------------

    def host_write(self, buf: FakeBuffer, values: np.ndarray) -> None:
        """The host writes the first rows of a pinned buffer in place."""
        if not buf.host:
            raise DeviceViolation("I7", f"the host wrote device memory {buf.name} directly")
        if buf.pending[buf.held] or buf.issued != buf.held:
            raise DeviceViolation(
                "I5",
                f"the host overwrote {buf.name} while a queued copy "
                "still reads or writes it: the buffer was reused too early",
            )
        buf.value[: len(values)] = values
        buf.issued += 1
        buf.held = buf.issued

    def host_read(self, buf: FakeBuffer, version: int | None = None) -> Any:
        """The host reads a pinned buffer, expecting the data of write ``version`` (default:
        the last one issued)."""
        if not buf.host:
            raise DeviceViolation("I7", f"the host read device memory {buf.name} directly")
        want = buf.issued if version is None else version
        if buf.held < want:
            raise DeviceViolation(
                "I7",
                f"the host read {buf.name} before the copy into it "
                "executed: nothing waited for its event",
            )
        if buf.held > want:
            raise DeviceViolation(
                "I5",
                f"a later copy overwrote {buf.name} before the host "
                "read it: the slot was reused too early",
            )
        return buf.value


# ---- the runtime on the fake device --------------------------------------------------------

_M64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A stable 64-bit hash of integers: the stand-in model's arithmetic."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _M64)) * 0xBF58476D1CE4E5B9) & _M64
        h ^= h >> 31
    return h


def _copy_rows(dst: FakeBuffer, src: FakeBuffer, b: int) -> None:
    dst.value[:b] = src.value[:b]


class _FakeSlot:
    """One pipeline slot's buffers and events (SlotBuffers of the real runtime)."""

    def __init__(self, device: FakeDevice, slot: int, rows: int) -> None:
        def buf(name: str, value: Any, **kw: Any) -> FakeBuffer:
            return device.buffer(f"slot{slot}.{name}", value, slot=slot, **kw)

        self.launch_host = buf("launch_host", np.zeros((rows, 2), np.int64), host=True)
        self.launch_dev = buf("launch_dev", np.zeros((rows, 2), np.int64))
        self.fin_host = buf("fin_host", np.zeros((rows, N_FIN), np.int64), host=True)
        self.fin_dev = buf("fin_dev", np.zeros((rows, N_FIN), np.int64))
        self.hidden = buf("hidden", [])
        # A copy reading outputs not yet written waited on the wrong event, or none (I3).
        self.out_dev = buf("out_dev", np.zeros((rows, N_OUT), np.float32), early_read="I3")
        self.out_host = buf("out_host", np.zeros((rows, N_OUT), np.float32), host=True)
        self.inputs_ready = device.event(f"slot{slot}.inputs_ready")
        self.mask_ready = device.event(f"slot{slot}.mask_ready")
        self.step_done = device.event(f"slot{slot}.step_done")
        self.d2h_done = device.event(f"slot{slot}.d2h_done")


@dataclass(eq=False)
class _InFlight:
    """A launched step whose outputs the scheduler has not read back yet."""

    slot: int
    rows: list[int]
    pages: set[int]
    finalized: bool = False
    d2h_version: int = 0


class _CheckedPages(PageAllocator):
    """The page allocator, reporting pages whose last reference went away (I6 check)."""

    def __init__(self, on_free: Callable[[set[int]], None], *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_free = on_free

    def release(self, pages: list[int]) -> None:
        super().release(pages)
        freed = {p for p in pages if self.refcount[p] == 0}
        if freed:
            self._on_free(freed)


class FakeRuntime:
    """The runtime protocol on a `FakeDevice`, enqueuing what `ModelRuntime` enqueues.

    The stand-in model: a prefill hashes the prompt and image into a row state; each decode
    forward folds the row's next input (written on the device by the previous finalize) into
    it. Sampling picks, among the tokens the row's mask allows, eos from an output index the
    prefill derived from the prompt, else a token chosen by the state; coordinates and sizes
    come from the state too. So answers depend on every value flowing through the device, and
    equal requests get equal answers whatever the depth or interleaving.
    """

    def __init__(
        self,
        device: FakeDevice,
        cfg: EngineConfig,
        table: MaskTable,
        *,
        n_pages: int,
        max_context: int,
        eos_id: int,
        coord_id: int,
        skip_d2h_wait: bool = False,
        skip_step_done_wait: bool = False,
        skip_mask_wait: bool = False,
        skip_inputs_wait: bool = False,
        stream_per_slot: bool = False,
    ) -> None:
        self.device = device
        self.cfg = cfg
        self.table = table
        self.eos_id = eos_id
        self.coord_id = coord_id
        # Faults: each removes one wait of the real operation sequence.
        self.skip_d2h_wait = skip_d2h_wait  # read_outputs reads without the host wait
        self.skip_step_done_wait = skip_step_done_wait  # the D2H copy ignores step_done
        self.skip_mask_wait = skip_mask_wait  # sampling ignores mask_ready
        self.skip_inputs_wait = skip_inputs_wait  # the forward ignores inputs_ready
        rows = cfg.max_rows
        max_pages = -(-max_context // cfg.page_size)
        # The host mirror of the block table (pinned in the real runtime; the allocator writes
        # it in place and the next launch uploads the changed rows).
        self.block_host = np.zeros((rows, max_pages), np.int32)
        self.pages: PageAllocator = _CheckedPages(
            self._check_freed, n_pages, cfg.page_size, rows, max_pages, block_table=self.block_host
        )
        self.copy = device.stream("copy")
        names = ["compute0", "compute1"] if stream_per_slot else ["compute"]
        self.computes = [device.stream(n) for n in names]
        self.block_dev = [
            device.buffer(f"block_dev[{r}]", np.zeros(max_pages, np.int32)) for r in range(rows)
        ]
        self.row_state = [device.buffer(f"row_state[{r}]", None) for r in range(rows)]
        self.next_input = [device.buffer(f"next_input[{r}]", None) for r in range(rows)]
        # Device copy of the mask table: row id -> bool [width], rows as last uploaded.
        self.table_dev = device.buffer("table_dev", {})
        self.slots = [_FakeSlot(device, i, rows) for i in range(2)]
        self._in_flight: deque[_InFlight] = deque()
        self._tags = itertools.count(1)  # tells a row's successive occupants apart
        self._all_ids = np.arange(table.width)

    # ---- the protocol ---------------------------------------------------------------------

    def launch_prefill(
        self, slot: int, seqs: list[Sequence], image_for: dict[int, torch.Tensor | None]
    ) -> None:
        """Block-table upload and inputs_ready on the copy stream; the prefill waits for it."""
        if sorted(image_for) != list(range(len(seqs))):
            raise DeviceViolation("data", f"prefill images for rows {sorted(image_for)}")
        buf = self.slots[slot]
        self._begin(slot, seqs)
        self._upload_block_table()
        buf.inputs_ready.record(self.copy)
        compute = self._compute(slot)
        if not self.skip_inputs_wait:
            compute.wait(buf.inputs_ready)
        jobs = []
        for s in seqs:
            image = s.request.image
            salt = zlib.crc32(image.content_hash.encode()) if image is not None else 0
            jobs.append((s.row, next(self._tags), _mix(salt, *s.prompt), s.prefill_len))
        rows = [s.row for s in seqs]
        blocks = {r: self.block_host[r].copy() for r in rows}
        compute.kernel(
            f"prefill slot{slot}",
            partial(self._prefill, buf, jobs, blocks),
            [self.block_dev[r] for r in rows],
            [buf.hidden, *(self.row_state[r] for r in rows)],
        )

    def launch_decode(self, slot: int, seqs: list[Sequence]) -> None:
        """Inputs into the pinned buffer, uploaded on the copy stream; the forward waits."""
        buf, b = self.slots[slot], len(seqs)
        self._begin(slot, seqs)
        rows = [s.row for s in seqs]
        host = np.array([[s.row, s.next_position()] for s in seqs], np.int64).reshape(b, 2)
        self.device.host_write(buf.launch_host, host)
        self._upload_block_table()
        self.copy.copy(
            f"h2d inputs slot{slot}",
            partial(_copy_rows, buf.launch_dev, buf.launch_host, b),
            [buf.launch_host],
            [buf.launch_dev],
        )
        buf.inputs_ready.record(self.copy)
        compute = self._compute(slot)
        if not self.skip_inputs_wait:
            compute.wait(buf.inputs_ready)
        blocks = {r: self.block_host[r].copy() for r in rows}
        reads = [
            buf.launch_dev,
            *(self.block_dev[r] for r in rows),
            *(self.row_state[r] for r in rows),
            *(self.next_input[r] for r in rows),
        ]
        compute.kernel(
            f"decode forward slot{slot}",
            partial(self._decode_forward, buf, rows, blocks),
            reads,
            [buf.hidden, *(self.row_state[r] for r in rows)],
        )

    def finalize(
        self,
        slot: int,
        seqs: list[Sequence],
        fin: np.ndarray,
        constrained: bool,
        regions: bool,
        greedy: bool = False,
    ) -> None:
        """Mask upload + mask_ready (copy); sample + step_done (compute); D2H after step_done,
        then d2h_done (copy)."""
        buf, b = self.slots[slot], len(seqs)
        step = self._finalizing(slot, seqs, fin)
        self._check_flags(fin, constrained, regions, greedy)
        self.device.host_write(buf.fin_host, fin)
        if constrained:
            self._upload_table_rows()
        self.copy.copy(
            f"h2d fin slot{slot}",
            partial(_copy_rows, buf.fin_dev, buf.fin_host, b),
            [buf.fin_host],
            [buf.fin_dev],
        )
        buf.mask_ready.record(self.copy)
        compute = self._compute(slot)
        if not self.skip_mask_wait:
            compute.wait(buf.mask_ready)
        reads = [buf.fin_dev, buf.hidden, *([self.table_dev] if constrained else [])]
        writes = [buf.out_dev, *(self.next_input[r] for r in step.rows)]
        compute.kernel(
            f"sample slot{slot}", partial(self._sample, buf, b, constrained, regions), reads, writes
        )
        buf.step_done.record(compute)
        if not self.skip_step_done_wait:
            self.copy.wait(buf.step_done)
        self.copy.copy(
            f"d2h outputs slot{slot}",
            partial(_copy_rows, buf.out_host, buf.out_dev, b),
            [buf.out_dev],
            [buf.out_host],
        )
        step.d2h_version = buf.out_host.issued
        buf.d2h_done.record(self.copy)

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """The one host wait: d2h_done of the oldest step, which must be this one (I2)."""
        step = self._in_flight[0] if self._in_flight else None
        if step is None or step.slot != slot or len(step.rows) != b or not step.finalized:
            raise DeviceViolation(
                "I2", f"commit of slot {slot} ({b} rows) is not the oldest finalized step in flight"
            )
        buf = self.slots[slot]
        if not self.skip_d2h_wait:
            buf.d2h_done.synchronize()
        out = self.device.host_read(buf.out_host, step.d2h_version)
        self._in_flight.popleft()
        return out[:b]

    def release_row(self, row: int) -> None:
        if any(row in s.rows for s in self._in_flight):
            raise DeviceViolation("I6", f"row {row} released while a step holding it is in flight")
        self.pages.clear(row)

    # ---- bookkeeping checks ---------------------------------------------------------------

    def _compute(self, slot: int) -> FakeStream:
        return self.computes[slot % len(self.computes)]

    def _begin(self, slot: int, seqs: list[Sequence]) -> None:
        if any(s.slot == slot for s in self._in_flight):
            raise DeviceViolation(
                "I5", f"launch into slot {slot} while the step using it is not committed"
            )
        rows = [s.row for s in seqs]
        if min(rows, default=0) < 0 or len(set(rows)) != len(rows):
            raise DeviceViolation("data", f"launch with rows {rows}")
        pages = set(self.block_host[rows].ravel().tolist()) - {SINK_PAGE}
        self._in_flight.append(_InFlight(slot, rows, pages))

    def _finalizing(self, slot: int, seqs: list[Sequence], fin: np.ndarray) -> _InFlight:
        step = next((s for s in self._in_flight if not s.finalized), None)
        rows = [s.row for s in seqs]
        if step is None or step.slot != slot or step.rows != rows or fin[:, F_ROW].tolist() != rows:
            raise DeviceViolation(
                "I2", f"finalize of slot {slot} rows {rows} is not the oldest unfinalized launch"
            )
        step.finalized = True
        return step

    def _check_flags(self, fin: np.ndarray, constrained: bool, regions: bool, greedy: bool) -> None:
        phases = set(fin[:, F_PHASE].tolist())
        if (fin[:, F_MASK] != NO_MASK).any() and not constrained:
            raise DeviceViolation("data", "masked rows in a step finalized unconstrained")
        if phases & {PHASE_BOUNDARY, PHASE_COORD, PHASE_SIZE} and not regions:
            raise DeviceViolation("data", "region rows in a step finalized without regions")
        if greedy and (fin.view(np.float64)[:, F_TEMP] > 0).any():
            raise DeviceViolation("data", "a sampled row in a step finalized greedy")

    def _check_freed(self, pages: set[int]) -> None:
        busy = pages & set().union(*(s.pages for s in self._in_flight))
        if busy:
            raise DeviceViolation(
                "I6", f"pages {sorted(busy)} freed while a step in flight still uses them"
            )

    # ---- uploads ----------------------------------------------------------------------------

    def _upload_block_table(self) -> None:
        rows = self.pages.take_dirty()
        if rows:
            lo, hi = rows[0], rows[-1] + 1  # one copy covering every dirty row, as the real one
            self.copy.copy(
                "h2d block table",
                partial(self._copy_blocks, lo, hi, self.block_host[lo:hi].copy()),
                [],
                self.block_dev[lo:hi],
            )

    def _copy_blocks(self, lo: int, hi: int, issued: np.ndarray) -> None:
        # The real runtime copies from a per-slot pinned stage filled at issue time, so the
        # device gets the rows as they were when the upload was enqueued.
        for r in range(lo, hi):
            self.block_dev[r].value = issued[r - lo].copy()

    def _upload_table_rows(self) -> None:
        for first, dense in self.table.take_dirty_runs():
            rows = dict(enumerate(dense, start=first))
            self.copy.copy("h2d mask rows", partial(self._write_rows, rows), [], [self.table_dev])

    def _write_rows(self, rows: dict[int, np.ndarray]) -> None:
        self.table_dev.value = {**self.table_dev.value, **rows}

    # ---- the stand-in model (runs on the device) ------------------------------------------

    def _check_blocks(self, row: int, want: np.ndarray, what: str) -> None:
        have = self.block_dev[row].value
        if not np.array_equal(have, want):
            raise DeviceViolation(
                "order",
                f"{what} read block-table row {row} as "
                f"{have.tolist()}, launched with {want.tolist()}",
            )

    def _prefill(
        self, buf: _FakeSlot, jobs: list[tuple[int, int, int, int]], blocks: dict[int, np.ndarray]
    ) -> None:
        hidden = []
        for row, tag, h, prefill_len in jobs:
            self._check_blocks(row, blocks[row], "prefill")
            eos_at = h % 11  # the output index at which this answer wants to stop
            self.row_state[row].value = (tag, h, 0, eos_at, prefill_len)
            hidden.append((row, tag, h, 0, eos_at))
        buf.hidden.value = hidden

    def _decode_forward(
        self, buf: _FakeSlot, rows: list[int], blocks: dict[int, np.ndarray]
    ) -> None:
        launch = buf.launch_dev.value[: len(rows)].tolist()
        if [r for r, _ in launch] != rows:
            raise DeviceViolation("order", f"decode forward read rows {launch}, launched {rows}")
        hidden = []
        for row, pos in launch:
            self._check_blocks(row, blocks[row], "decode forward")
            tag, h, k, eos_at, next_pos = self.row_state[row].value
            in_tag, in_k, value = self.next_input[row].value
            if (in_tag, in_k) != (tag, k):
                raise DeviceViolation(
                    "order",
                    f"decode forward of row {row} read the next "
                    f"input of output {in_k} (occupant {in_tag}), but output "
                    f"{k} (occupant {tag}) is the last one sampled",
                )
            if pos != next_pos:
                raise DeviceViolation(
                    "data",
                    f"decode forward of row {row} at position {pos}, the row is at {next_pos}",
                )
            h = _mix(h, value)
            self.row_state[row].value = (tag, h, k + 1, eos_at, pos + 1)
            hidden.append((row, tag, h, k + 1, eos_at))
        buf.hidden.value = hidden

    def _sample(self, buf: _FakeSlot, b: int, constrained: bool, regions: bool) -> None:
        fin = buf.fin_dev.value[:b]
        hidden = buf.hidden.value
        if [x[0] for x in hidden] != fin[:, F_ROW].tolist():
            raise DeviceViolation("order", "sampling rows differ from the forward's rows")
        out = buf.out_dev.value
        table = self.table_dev.value
        for i, (row, tag, h, k, eos_at) in enumerate(hidden):
            phase, mask = int(fin[i, F_PHASE]), int(fin[i, F_MASK])
            allowed = None
            if constrained and mask != NO_MASK:
                if mask not in table:
                    raise DeviceViolation(
                        "order", f"sampling used mask row {mask} before its upload executed"
                    )
                allowed = table[mask]
                # A row a live request holds never changes on the host: a device copy that
                # differs is a reclaimed row whose rewrite was never uploaded.
                if not np.array_equal(allowed, self.table.allowed(mask)):
                    raise DeviceViolation("data", f"mask row {mask} on the device is stale")
            token = self._choose(h, k, eos_at, allowed)
            out[i, 0] = token
            value = token
            if regions:
                coord = ((h >> 8) % 1000) / 1000
                size = (((h >> 20) % 400) / 1000, ((h >> 32) % 400) / 1000)
                out[i, 1], out[i, 2], out[i, 3] = coord, *size
                if phase == PHASE_SIZE:
                    value = _mix(round(size[0] * 1e6), round(size[1] * 1e6))
                elif phase != PHASE_TOKEN:
                    value = round(coord * 1e6)
            self.next_input[row].value = (tag, k, value)

    def _choose(self, h: int, k: int, eos_at: int, allowed: np.ndarray | None) -> int:
        eos = self.eos_id
        if k >= eos_at and (allowed is None or allowed[eos]):
            return eos
        ids = self._all_ids if allowed is None else np.flatnonzero(allowed)
        ids = ids[ids != eos]
        return int(ids[h % len(ids)]) if len(ids) else eos


class EarlySlotReusePipeline(PipelineState):
    """Fault: a step's slot is handed out again as soon as the step is finalized, before the
    commit that reads its host buffers (the real pipeline holds it until `complete`)."""

    def mark_finalized(self, step: Step) -> None:
        super().mark_finalized(step)
        self.slots[step.slot] = None

    def complete(self, step: Step) -> None:
        if step.state is not SlotState.COMMITTING:
            raise PipelineError(f"complete of step {step.step_id} in state {step.state}")
        if self.slots[step.slot] is step:
            self.slots[step.slot] = None
        step.state = SlotState.FREE
