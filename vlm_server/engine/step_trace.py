"""A trace of the engine's steps, for telling where the gaps between decode steps come from.

Off by default (``--step-trace FILE``). While on, every step records its kind and rows, the
scheduler's host time around its commit, the scheduler thread's CPU time, the garbage
collections that ran, and (on CUDA) its forward and sampling on the device, from the timing
events the runtime records for an observer that asks for them. The last ``max_steps`` steps
are written to FILE as JSON when the engine closes; ``bench/step_gaps.py`` reads it.

What a step costs with the trace on: two or four CUDA events and a few dozen microseconds
of host time, on the scheduler thread. Not for a server that is being measured for
throughput.
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from vlm_server.engine.core.observer import Observer
from vlm_server.engine.core.pipeline import LaunchKind, Step

log = logging.getLogger(__name__)

# The row fields, in the order of each row's list in the file.
FIELDS = (
    "t",  # host seconds (time.time()) when the step's outputs were read
    "step",
    "kind",  # "decode" or "mixed"
    "rows",
    "decode_rows",
    "prefill",  # an image prefix batch was in flight at launch
    "wait_ms",  # the commit's wait for the step's outputs
    "commit_ms",  # the tick's parts (the commit includes the wait)
    "finalize_ms",
    "launch_ms",
    "tick_wall_ms",  # the scheduler thread since its previous commit: wall and CPU time
    "tick_cpu_ms",
    "gc_ms",  # collections in this process since the previous commit, any thread
    "forward_start_ms",  # device times, from the first step's forward (None off CUDA)
    "forward_ms",
    "sample_start_ms",
    "sample_ms",
)


class StepTrace(Observer):
    """Records the last ``max_steps`` steps; `closed` writes them to ``path``."""

    device_timing = True

    def __init__(self, path: str | os.PathLike[str], max_steps: int = 100_000) -> None:
        if max_steps < 1:
            raise ValueError("step_trace_steps must be >= 1")
        self.path = Path(path)
        self.rows: collections.deque[list[Any]] = collections.deque(maxlen=max_steps)
        self._open: dict[int, dict[str, Any]] = {}  # launched, not yet committed
        self._launched: dict[str, Any] | None = None
        self._finalized: dict[str, Any] | None = None
        self._committing: dict[str, Any] | None = None
        self._ref: object = None  # the device clock's zero: the first forward's start
        self._last = (time.perf_counter(), time.thread_time())
        # Collections' seconds since the last commit; no lock: a collection can start inside
        # any allocation, the scheduler's own included (a racy read is fine for a trace).
        self._gc_pauses: list[float] = []
        self._gc_started: dict[int, float] = {}
        # Whether a prefix batch is in flight, asked at each launch (the runtime's event query).
        self.prefill_busy = lambda: False
        gc.callbacks.append(self._on_gc)

    # ---- the observer hooks (the scheduler thread) ---------------------------------------

    def launched(self, step: Step) -> None:
        decode_rows = len(step.seqs) if step.plan is None else step.plan.n_decode
        rec = {
            "step": step.step_id,
            "kind": "decode" if step.kind is LaunchKind.DECODE else "mixed",
            "rows": len(step.seqs),
            "decode_rows": decode_rows,
            "prefill": bool(self.prefill_busy()),
        }
        self._open[step.step_id] = rec
        self._launched = rec

    def forward_timed(self, kind: str, start: object, end: object) -> None:
        if self._launched is not None:
            if self._ref is None:
                self._ref = start
            self._launched["fwd"] = (start, end)

    def finalized(self, step: Step) -> None:
        self._finalized = self._open.get(step.step_id)

    def sample_timed(self, start: object, end: object) -> None:
        if self._finalized is not None:
            self._finalized["sample"] = (start, end)

    def committed(self, step: Step) -> None:
        self._committing = self._open.pop(step.step_id, None)

    def waited(self, seconds: float) -> None:
        rec = self._committing
        if rec is not None:
            rec["t"] = time.time()
            rec["wait_ms"] = seconds * 1e3
            # The outputs were read: the step's events have completed, so their times are
            # a host call each, not a wait.
            rec["device"] = self._device_times(rec.pop("fwd", None), rec.pop("sample", None))

    def tick(self, commit_s: float, finalize_s: float, launch_s: float) -> None:
        rec, self._committing = self._committing, None
        if rec is None or "t" not in rec:
            return
        now = (time.perf_counter(), time.thread_time())
        wall, cpu = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        pauses, self._gc_pauses = self._gc_pauses, []
        gc_s = sum(pauses)
        fwd_at, fwd_ms, smp_at, smp_ms = rec["device"]
        self.rows.append(
            [
                rec["t"],
                rec["step"],
                rec["kind"],
                rec["rows"],
                rec["decode_rows"],
                rec["prefill"],
                _ms(rec["wait_ms"]),
                _ms(commit_s * 1e3),
                _ms(finalize_s * 1e3),
                _ms(launch_s * 1e3),
                _ms(wall * 1e3),
                _ms(cpu * 1e3),
                _ms(gc_s * 1e3),
                fwd_at,
                fwd_ms,
                smp_at,
                smp_ms,
            ]
        )

    def closed(self) -> None:
        """Write the trace (the engine has stopped its scheduler)."""
        gc.callbacks[:] = [cb for cb in gc.callbacks if cb != self._on_gc]
        out = {"fields": list(FIELDS), "rows": list(self.rows)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(out))
        except OSError as err:
            log.error("could not write the step trace to %s: %s", self.path, err)
            return
        log.info("step trace: %d steps written to %s", len(self.rows), self.path)

    # ---- helpers ---------------------------------------------------------------------------

    def _device_times(
        self, fwd: tuple[object, object] | None, smp: tuple[object, object] | None
    ) -> tuple[float | None, float | None, float | None, float | None]:
        ref = self._ref
        if ref is None or not hasattr(ref, "elapsed_time"):  # CPU events carry no clock
            return None, None, None, None
        out: list[float | None] = []
        for pair in (fwd, smp):
            if pair is None:
                out += [None, None]
                continue
            start, end = pair
            at = ref.elapsed_time(start)  # type: ignore[attr-defined]
            out += [_ms(at), _ms(ref.elapsed_time(end) - at)]  # type: ignore[attr-defined]
        return out[0], out[1], out[2], out[3]

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Runs in whichever thread collects, so it takes no lock.
        ident = threading.get_ident()
        if phase == "start":
            self._gc_started[ident] = time.perf_counter()
            return
        t = self._gc_started.pop(ident, None)
        if t is not None:
            self._gc_pauses.append(time.perf_counter() - t)


def _ms(x: float) -> float:
    return round(x, 4)


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A written trace's rows, each a dict of `FIELDS`."""
    data = json.loads(Path(path).read_text())
    fields = data["fields"]
    return [dict(zip(fields, row, strict=True)) for row in data["rows"]]
