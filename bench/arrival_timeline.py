"""What the arrivals benchmark (`bench.arrival_itl`) records: the phase windows, the caption
streams' inter-token gaps, and the names of the phases and of the server metrics it samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.load_gen import Record

TARGET_RATIO = 2.0
PHASES = ("A", "B")
PHASE_NAMES = {"A": "A baseline", "B": "B +arrivals"}
STEP_INTERVAL = "vlm_step_interval_seconds"
EVENTS_DELAY = "vlm_engine_events_delay_seconds"


@dataclass
class Gap:
    end: float  # perf_counter seconds of the later delta
    seconds: float
    stream: int


@dataclass
class Timeline:
    """The phase windows (perf_counter seconds) and everything seen during the run."""

    start: float
    warmup_end: float
    a_end: float
    b_end: float
    gaps: list[Gap] = field(default_factory=list)
    streams: list[tuple[float, int, Record]] = field(default_factory=list)  # (end, worker, rec)
    step_samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, ms, batch
    loop_lag: list[tuple[float, float]] = field(default_factory=list)  # t, seconds late
    # The server's step-interval histogram (vlm_step_interval_seconds) as sampled: t, buckets.
    intervals: list[tuple[float, dict[float, float]]] = field(default_factory=list)
    # The server's engine-events delay histogram (vlm_engine_events_delay_seconds), likewise.
    delays: list[tuple[float, dict[float, float]]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # issue times (perf_counter)
    stopping: bool = False

    def phase(self, at: float) -> str | None:
        """The phase a moment belongs to (None: warm-up or after the run)."""
        if self.warmup_end <= at < self.a_end:
            return "A"
        if self.a_end <= at < self.b_end:
            return "B"
        return None


def stream_deltas(rec: Record, t0: float) -> list[float]:
    """The perf_counter times of a finished stream's deltas, rebuilt from its record: the
    first at ``t0 + ttft``, each later one a gap after the one before."""
    if not rec.ok or not rec.streamed:
        return []
    times = [t0 + rec.ttft_s]
    for g in rec.gaps_s:
        times.append(times[-1] + g)
    return times
