"""A small device shim: streams, events and pinned buffers on CUDA, no-ops on the CPU.

The scheduler and runtime use only this, so CPU tests run the production code paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class CpuEvent:
    """An event on the CPU: work runs synchronously, so it is complete once recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class DeviceStreams:
    """One compute stream and one copy stream (None on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.compute = torch.cuda.Stream(device) if self.is_cuda else None
        self.copy = torch.cuda.Stream(device) if self.is_cuda else None

    def event(self) -> torch.cuda.Event | CpuEvent:
        return torch.cuda.Event() if self.is_cuda else CpuEvent()

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def wait(self, stream: torch.cuda.Stream | None, event: torch.cuda.Event | CpuEvent) -> None:
        """Make ``stream`` wait for ``event`` on the device (never a host wait)."""
        if stream is not None:
            stream.wait_event(event)  # type: ignore[arg-type]

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=self.is_cuda)
