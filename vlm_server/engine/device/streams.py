"""The device surface the runtime enqueues through: streams, events, buffers, copies, kernels.

`TorchDevice` is the production implementation: CUDA streams and events, or synchronous
execution on the CPU where streams and events are no-ops. The runtime never touches a stream,
an event or a pinned buffer except through these calls, so a test double with the same surface
(tests/support/fake_device.py: per-stream FIFO queues, real event semantics, versioned
buffers, seeded interleavings) runs the production runtime unchanged and checks the pipeline
invariants on the code that ships.

Every enqueue names what it touches through ``access``: a callable returning (reads, writes),
each a list of whole buffers or ``(buffer, rows)`` pairs. Production never calls it (no host
work in the hot path); the fake device calls it at issue time to version the buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vlm_server.chip_features import auto_prefill_sms, current_chip
from vlm_server.engine.config import PREFILL_SMS_AUTO

if TYPE_CHECKING:
    from vlm_server.engine.core.observer import Observer

Region = torch.Tensor | tuple[torch.Tensor, Sequence[int]]
Access = Callable[[], tuple[Sequence[Region], Sequence[Region]]]


class Event(Protocol):
    def query(self) -> bool: ...


class Device(Protocol):
    """What the runtime needs from a device (see the module docstring)."""

    is_cuda: bool
    compute_stream: object  # every step's forward and every sampling (I1)
    copy_stream: object  # uploads and the result copy back, ordered by events
    # New image prefixes (image path, BOS + image forward), at a lower priority than the
    # compute stream; they write only their own pages, which no step reads before they are done.
    prefill_stream: object
    # A second prefill lane in an SM partition, or None (prefill.py: PrefillLane).
    partitioned_prefill_stream: object
    # A stream in the partition that the prefill graphs are captured on, or None.
    prefill_capture_stream: object
    # Interactive pictures while background work runs, ahead of the compute stream
    # (prefill.py: the interactive lane).
    interactive_prefill_stream: object

    def event(self, name: str, blocking: bool = False) -> Event:
        """``blocking``: a host thread waiting for it sleeps instead of spinning."""
        ...

    def host_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slot: int | None = None
    ) -> torch.Tensor:
        """Pinned host memory that copies read or land in."""
        ...

    def buffer(
        self,
        name: str,
        tensor: torch.Tensor,
        slot: int | None = None,
        early_read: str = "order",
    ) -> torch.Tensor:
        """Register device memory by name (the fake versions it); returns ``tensor``."""
        ...

    def kernel(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        """Enqueue compute work on ``stream``."""
        ...

    def copy(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        """Enqueue a memory copy on ``stream``."""
        ...

    def record(self, event: Event, stream: object) -> None: ...

    def wait(self, stream: object, event: Event) -> None:
        """Later work on ``stream`` waits for ``event`` on the device (never a host wait)."""
        ...

    def host_write(self, buffer: torch.Tensor, values: np.ndarray, start: int = 0) -> None:
        """The host writes rows ``start..`` of a pinned buffer in place."""
        ...

    def host_read(self, buffer: torch.Tensor) -> np.ndarray:
        """The host reads a pinned buffer (after waiting for the copy into it)."""
        ...

    def host_wait(self, event: Event) -> None:
        """Block the host until ``event`` completed: the tick's one intended sync."""
        ...


class CpuEvent:
    """An event on the CPU: work runs synchronously, so it is complete once recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def timing_mark(observer: Observer, dev: Device) -> object | None:
    """A timing event on the current stream, only while an observer asks for them."""
    if not observer.device_timing:
        return None
    event = torch.cuda.Event(enable_timing=True) if dev.is_cuda else CpuEvent()
    event.record()
    return event


log = logging.getLogger(__name__)


def resolved_prefill_sms(asked: int, device: torch.device) -> int:
    """The partition's SMs for the config value ``asked``: itself, or for
    ``PREFILL_SMS_AUTO`` the chip's share (chip_features.auto_prefill_sms), said in the log."""
    if asked != PREFILL_SMS_AUTO:
        return asked
    if device.type != "cuda":
        return 0
    sms, why = auto_prefill_sms(current_chip(str(device)))
    log.info("prefill_sms auto: %s", why)
    return sms


# (device index, SMs) -> (green context, its two streams), made once per process.
_PARTITIONS: dict[tuple[int, int], tuple[object, list[object]]] = {}


def partitioned_streams(device: torch.device, num_sms: int) -> tuple[object, list[object]]:
    """Two streams whose kernels run on at most ``num_sms`` of ``device``'s SMs (a CUDA green
    context; the driver may round the count to its SM granularity), and the context. Graphs
    keep the partition only when captured on such a stream.

    One context per (device, size) lives as long as the process and is shared by every engine
    in it: destroying a green context destroys its streams, which the caching allocator and
    captured graphs may still name, and torch's destructor aborts the process on any driver
    error (at interpreter exit, say), so the context is never destroyed."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < num_sms < sms:
        raise ValueError(f"prefill_sms must be in 1..{sms - 1} on this device, got {num_sms}")
    key = (index, num_sms)
    if key in _PARTITIONS:
        return _PARTITIONS[key]
    try:
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=num_sms, device_id=index)
    except (ImportError, RuntimeError, AttributeError) as err:
        raise RuntimeError(
            f"prefill_sms needs CUDA green contexts (this torch and driver: {err})"
        ) from err
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(ctx))  # never freed, even at exit (above)
    if hasattr(ctx, "Stream"):
        streams = [ctx.Stream(), ctx.Stream()]
    else:
        ctx.set_context()  # older torch: streams made while the green context is current
        try:
            streams = [torch.cuda.Stream(index), torch.cuda.Stream(index)]
        finally:
            ctx.pop_context()
    _PARTITIONS[key] = (ctx, streams)
    return ctx, streams


class TorchDevice:
    """Compute, copy and prefill streams on CUDA; synchronous no-op streams on the CPU.

    ``prefill_sms`` > 0 makes a partition of that many SMs (see `partitioned_streams`): the
    prefill stream itself, or with ``both_lanes`` a second one, ``partitioned_prefill_stream``,
    beside an unpartitioned prefill stream. ``prefill_capture_stream`` is a second stream of
    the partition, for graphs captured while the partitioned stream is busy (the crops')."""

    def __init__(
        self, device: torch.device, prefill_sms: int = 0, both_lanes: bool = False
    ) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.prefill_capture_stream: object = None
        self.partitioned_prefill_stream: object = None
        if prefill_sms and not self.is_cuda:
            raise ValueError(f"prefill_sms needs a CUDA device; the model is on {device}")
        if self.is_cuda:
            # Lower numbers run first: decode steps get SMs ahead of a new image's prefix,
            # and an interactive picture ahead of both while background work fills them.
            self.compute_stream = torch.cuda.Stream(device, priority=-1)
            self.interactive_prefill_stream = torch.cuda.Stream(device, priority=-2)
            self.copy_stream = torch.cuda.Stream(device)
            if prefill_sms:
                _, (part, capture) = partitioned_streams(device, prefill_sms)  # lives on
                self.prefill_capture_stream = capture
                if both_lanes:
                    self.prefill_stream = torch.cuda.Stream(device, priority=0)
                    self.partitioned_prefill_stream = part
                else:
                    self.prefill_stream = part
            else:
                self.prefill_stream = torch.cuda.Stream(device, priority=0)
        else:
            self.compute_stream = self.copy_stream = self.prefill_stream = None
            self.interactive_prefill_stream = None

    def event(self, name: str, blocking: bool = False) -> torch.cuda.Event | CpuEvent:
        return torch.cuda.Event(blocking=blocking) if self.is_cuda else CpuEvent()

    def host_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slot: int | None = None
    ) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=self.is_cuda)

    def buffer(
        self,
        name: str,
        tensor: torch.Tensor,
        slot: int | None = None,
        early_read: str = "order",
    ) -> torch.Tensor:
        return tensor

    def kernel(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        with self.on(stream):
            fn()

    def copy(self, stream: object, name: str, fn: Callable[[], None], access: Access) -> None:
        with self.on(stream):
            fn()

    def record(self, event: Event, stream: object) -> None:
        if stream is not None:
            event.record(stream)  # type: ignore[attr-defined]

    def wait(self, stream: object, event: Event) -> None:
        if stream is not None:
            stream.wait_event(event)  # type: ignore[attr-defined]

    def host_write(self, buffer: torch.Tensor, values: np.ndarray, start: int = 0) -> None:
        # A pinned host buffer viewed as numpy: no device sync (slot reuse orders it, I5).
        buffer.numpy()[start : start + len(values)] = values

    def host_read(self, buffer: torch.Tensor) -> np.ndarray:
        # Pinned host memory; the caller waited for the copy into it with host_wait.
        return buffer.numpy()

    def host_wait(self, event: Event) -> None:
        if not isinstance(event, CpuEvent):
            event.synchronize()  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def on(self, stream: object) -> Iterator[None]:
        """Run enclosed work on ``stream`` (start-up paths such as graph capture use it)."""
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):  # type: ignore[arg-type]
                yield
