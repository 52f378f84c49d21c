"""A fake device with the production device surface, to run the real runtime and scheduler
and check the pipeline invariants of docs/architecture.md.

`FakeDevice` keeps what matters for ordering on a GPU: named streams, each a FIFO of
operations; events whose `record` enqueues a marker (the event completes once the device has
executed everything before the marker on that stream); `wait`, a barrier holding a stream until
the marker the event pointed at when the wait was issued has executed; and `host_wait`, which
runs the device until the event completed. Nothing executes unless a test calls `run` or the
host waits, and then in a seeded random interleaving of the streams, so a missing wait turns
into an observable race. Operations run their real torch work (on CPU tensors) when they
execute, not when they are issued.

Every buffer keeps versions: how many writes were issued (program order) and which one its
memory holds now. A read is issued against the version current at issue time, so executing it
checks that exactly that write landed and nothing overwrote it yet; a write checks that no
issued read of the previous contents is still queued. A ``(buffer, rows)`` access versions
each row on its own. Any violation raises `DeviceViolation` naming the invariant at stake.

Faults, for the tests that prove each wait matters: ``drop_waits`` / ``drop_records`` ignore
the waits on / records of the named events (by name without the ``slotN.`` prefix),
``skip_host_wait`` makes `host_wait` return at once, ``split_compute`` runs every other kernel
on a second compute stream. ``prefill_lanes`` adds the second prefill stream ("prefill_part").
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlm_server.engine.core.pipeline import PipelineError, PipelineState, SlotState, Step
from vlm_server.engine.device.streams import Access


class DeviceViolation(AssertionError):
    """An ordering bug caught by the fake device. ``invariant`` is the invariant of
    docs/architecture.md (I1..I7) it breaks, "order" for a missing wait on any other buffer, or
    "data" for a runtime call whose arguments contradict what was launched."""

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
        self.lagging: set[str] = set()  # streams that run only when no other one can
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

    def event(self, name: str, blocking: bool = False) -> FakeEvent:
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
        # A lagging stream runs only when nothing else can: the order a fault needs to show.
        prompt = [s for s in ready if s.name not in self.lagging] or ready
        stream = self.rng.choice(prompt)
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
        if stream.name.startswith("prefill"):  # image prefixes: ordered by their events
            return
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
        self._check_host_write(buf)
        buf.value[: len(values)] = values

    def _check_host_write(self, buf: FakeBuffer) -> None:
        if not buf.host:
            raise DeviceViolation("I7", f"the host wrote device memory {buf.name} directly")
        if buf.pending[buf.held] or buf.issued != buf.held:
            raise DeviceViolation(
                "I5",
                f"the host overwrote {buf.name} while a queued copy "
                "still reads or writes it: the buffer was reused too early",
            )
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


# ---- the production device surface on the fake device --------------------------------------


def _base(name: str) -> str:
    """An event's name without its slot: ``slot1.mask_ready`` -> ``mask_ready``."""
    return name.split(".", 1)[-1]


class FakeTorchDevice(FakeDevice):
    """`FakeDevice` behind the `Device` surface the production runtime enqueues through."""

    is_cuda = False

    def __init__(
        self,
        seed: int = 0,
        *,
        drop_waits: Iterable[str] = (),
        drop_records: Iterable[str] = (),
        skip_host_wait: bool = False,
        split_compute: bool = False,
        lagging: Iterable[str] = (),
        prefill_lanes: bool = False,
    ) -> None:
        super().__init__(seed)
        self.lagging = set(lagging)
        self.compute_stream = self.stream("compute")
        self.copy_stream = self.stream("copy")
        self.prefill_stream = self.stream("prefill")
        # A second prefill lane, as a partition used only while requests stream makes.
        self.partitioned_prefill_stream = self.stream("prefill_part") if prefill_lanes else None
        self.prefill_capture_stream = None  # graphs are captured where they replay
        self.interactive_prefill_stream = self.stream("prefill_interactive")
        self._second_compute = self.stream("compute2") if split_compute else None
        self._kernels = 0
        self.drop_waits = set(drop_waits)
        self.drop_records = set(drop_records)
        self.skip_host_wait = skip_host_wait
        self._meta: dict[int, FakeBuffer] = {}
        self._rows: dict[tuple[int, int], FakeBuffer] = {}
        self._tensors: list[torch.Tensor] = []  # keeps registered tensors (and their ids) alive
        # What the production runtime did, for tests that remove one wait or record at a time.
        self.waits_seen: set[tuple[str, str]] = set()  # (stream, event base name)
        self.records_seen: set[tuple[str, str]] = set()

    # ---- buffers -------------------------------------------------------------------------

    def _register(self, tensor: torch.Tensor, meta: FakeBuffer) -> torch.Tensor:
        self._meta[id(tensor)] = meta
        self._tensors.append(tensor)
        return tensor

    def host_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slot: int | None = None
    ) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype)
        return self._register(tensor, self.buffer_meta(name, tensor, host=True, slot=slot))

    def buffer(  # type: ignore[override]
        self,
        name: str,
        tensor: torch.Tensor,
        slot: int | None = None,
        early_read: str = "order",
    ) -> torch.Tensor:
        return self._register(
            tensor, self.buffer_meta(name, tensor, slot=slot, early_read=early_read)
        )

    def buffer_meta(self, name: str, value: Any, **kw: Any) -> FakeBuffer:
        return FakeDevice.buffer(self, name, value, **kw)

    def _regions(self, regions: Iterable[Any]) -> list[FakeBuffer]:
        out: list[FakeBuffer] = []
        for region in regions:
            if isinstance(region, tuple):
                tensor, rows = region
                meta = self._meta[id(tensor)]
                for r in rows:
                    key = (id(tensor), int(r))
                    if key not in self._rows:
                        self._rows[key] = FakeBuffer(
                            f"{meta.name}[{r}]", None, slot=meta.slot, early_read=meta.early_read
                        )
                    out.append(self._rows[key])
            else:
                out.append(self._meta[id(region)])
        return out

    # ---- enqueueing ----------------------------------------------------------------------

    def kernel(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        reads, writes = access()
        target = stream
        if self._second_compute is not None:
            self._kernels += 1
            target = self._second_compute if self._kernels % 2 == 0 else stream
        assert isinstance(target, FakeStream)
        target.kernel(name, fn, self._regions(reads), self._regions(writes))

    def copy(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        reads, writes = access()
        assert isinstance(stream, FakeStream)
        stream.copy(name, fn, self._regions(reads), self._regions(writes))

    def record(self, event: object, stream: object) -> None:
        assert isinstance(event, FakeEvent) and isinstance(stream, FakeStream)
        self.records_seen.add((stream.name, _base(event.name)))
        if _base(event.name) not in self.drop_records:
            event.record(stream)

    def wait(self, stream: object, event: object) -> None:  # type: ignore[override]
        assert isinstance(event, FakeEvent) and isinstance(stream, FakeStream)
        self.waits_seen.add((stream.name, _base(event.name)))
        if _base(event.name) not in self.drop_waits:
            stream.wait(event)

    # ---- the host ------------------------------------------------------------------------

    def host_write(  # type: ignore[override]
        self, buffer: torch.Tensor, values: np.ndarray, start: int = 0
    ) -> None:
        meta = self._meta[id(buffer)]
        self._check_host_write(meta)
        buffer.numpy()[start : start + len(values)] = values

    def host_read(self, buffer: torch.Tensor) -> np.ndarray:  # type: ignore[override]
        meta = self._meta[id(buffer)]
        FakeDevice.host_read(self, meta)
        return buffer.numpy()

    def host_wait(self, event: object) -> None:
        assert isinstance(event, FakeEvent)
        self.records_seen.add(("host", _base(event.name)))
        if not self.skip_host_wait:
            event.synchronize()


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
