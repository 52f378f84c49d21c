"""The arrivals benchmark's statistics (`bench.arrival_itl`): each phase's gaps, streams,
server step intervals and events delays summarized, the gap CDF points, and the verdict
against the target ratio."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.arrival_timeline import TARGET_RATIO, Timeline
from bench.load_gen import histogram_quantile, percentile

QUANTILES = (50, 90, 99, 99.9)


def _pcts(values: Sequence[float], prefix: str, scale: float = 1e3) -> dict[str, float]:
    xs = [v * scale for v in values]
    out = {f"{prefix}_p{q:g}_ms": percentile(xs, q) for q in QUANTILES}
    out[f"{prefix}_max_ms"] = max(xs) if xs else math.nan
    out[f"{prefix}_mean_ms"] = sum(xs) / len(xs) if xs else math.nan
    return out


def _phase_growth(
    samples: list[tuple[float, dict[float, float]]], tl: Timeline, phase: str
) -> dict[float, float] | None:
    """A sampled cumulative histogram's growth over a phase (between the samples at its start
    and end), or None without two samples in it."""
    lo, hi = (tl.warmup_end, tl.a_end) if phase == "A" else (tl.a_end, tl.b_end)
    first = next((b for at, b in samples if at >= lo), None)
    last = next((b for at, b in reversed(samples) if at <= hi), None)
    if first is None or last is None or first is last:
        return None
    return {b: last[b] - first.get(b, 0.0) for b in last}


def phases_unix(tl: Timeline) -> dict[str, tuple[float, float]]:
    """Each phase's window in time.time() seconds (the timeline keeps perf_counter's)."""
    offset = time.time() - time.perf_counter()
    return {
        "A": (tl.warmup_end + offset, tl.a_end + offset),
        "B": (tl.a_end + offset, tl.b_end + offset),
    }


def events_delays(tl: Timeline, phase: str) -> dict[str, Any]:
    """How long the engine process's events took to reach the server's streams over a phase
    (the delivery share of the clients' gaps; absent with the engine in the server's
    process)."""
    delta = _phase_growth(tl.delays, tl, phase)
    if not delta or not delta[max(delta)]:
        return {"events_delay_p50_ms": None, "events_delay_p99_ms": None}
    return {
        "events_delay_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "events_delay_p99_ms": histogram_quantile(0.99, delta) * 1e3,
    }


def server_intervals(tl: Timeline, phase: str) -> dict[str, Any]:
    """The server's own inter-token gaps over a phase (the step-interval histogram's growth
    between the samples at its start and end): free of the client's scheduling noise."""
    delta = _phase_growth(tl.intervals, tl, phase)
    if delta is None:
        return {"server_steps": 0, "server_itl_p50_ms": None, "server_itl_p99_ms": None}
    return {
        "server_steps": int(delta[max(delta)]),
        "server_itl_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "server_itl_p90_ms": histogram_quantile(0.90, delta) * 1e3,
        "server_itl_p99_ms": histogram_quantile(0.99, delta) * 1e3,
        # Cumulative counts by upper bound (seconds): where the tail sits, bucket by bucket.
        "server_itl_buckets": {repr(b): int(n) for b, n in sorted(delta.items())},
    }


def phase_summary(tl: Timeline, phase: str) -> dict[str, Any]:
    gaps = [g.seconds for g in tl.gaps if tl.phase(g.end) == phase]
    # Streams count in the phase in which they ended.
    recs = [r for end, _, r in tl.streams if tl.phase(end) == phase]
    ok = [r for r in recs if r.ok]
    tokens = [r.output_tokens for r in ok]
    # run_one puts the first delta at the end when there was none.
    deltas = [len(r.gaps_s) + (r.ttft_s < r.e2e_s) for r in ok]
    steps = [(ms, b) for at, ms, b in tl.step_samples if tl.phase(at) == phase]
    lag = [s for at, s in tl.loop_lag if tl.phase(at) == phase]
    row: dict[str, Any] = {
        "phase": phase,
        **server_intervals(tl, phase),
        **events_delays(tl, phase),
        "gaps": len(gaps),
        "streams_with_gaps": len({g.stream for g in tl.gaps if tl.phase(g.end) == phase}),
        **_pcts(gaps, "itl"),
        "streams_finished": len(recs),
        "stream_errors": dict(Counter(r.error for r in recs if not r.ok)),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else math.nan,
        "output_tokens_min": min(tokens) if tokens else 0,
        "output_tokens_max": max(tokens) if tokens else 0,
        "deltas_mean": sum(deltas) / len(deltas) if deltas else math.nan,
        "tokens_per_delta": sum(tokens) / sum(deltas) if deltas else math.nan,
        "server_step_samples": len(steps),
        "server_step_p50_ms": percentile([ms for ms, _ in steps], 50),
        "server_step_p90_ms": percentile([ms for ms, _ in steps], 90),
        "server_step_max_ms": max((ms for ms, _ in steps), default=math.nan),
        "server_batch_p50": percentile([b for _, b in steps if not math.isnan(b)], 50),
        "client_loop_lag_p99_ms": percentile([s * 1e3 for s in lag], 99),
        "client_loop_lag_max_ms": max(lag, default=math.nan) * 1e3,
    }
    return row


def cdf_points(tl: Timeline, phase: str) -> list[list[float]]:
    """(quantile %, gap ms) pairs from 0 to 100 in 0.5 steps, and the tail above 99: enough
    to redraw the CDF from the JSON."""
    ms = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == phase]
    if not ms:
        return []
    qs = [q / 2 for q in range(0, 199)] + [99.0 + q / 10 for q in range(1, 10)] + [99.95, 100.0]
    return [[q, percentile(ms, q)] for q in qs]


def verdict(tl: Timeline, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    period = a["itl_p50_ms"]
    known = bool(period) and not math.isnan(period)
    ratio = b["itl_p99_ms"] / period if known else math.nan
    step = a["server_step_p50_ms"]

    def over(phase: str) -> float:
        """The fraction of the phase's gaps longer than the target (2x phase A's p50)."""
        ms = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == phase]
        if not ms or not known:
            return math.nan
        return sum(1 for x in ms if x > TARGET_RATIO * period) / len(ms)

    return {
        "decode_period_ms": period,
        "decode_period_source": "phase A gap p50 (client)",
        "server_step_period_ms": step,
        "batch_size": a["server_batch_p50"],
        "ratio_b_p99_over_a_p50": ratio,
        "ratio_b_p99_over_server_step": (
            b["itl_p99_ms"] / step if step and not math.isnan(step) else math.nan
        ),
        "ratio_a_p99_over_a_p50": a["itl_p99_ms"] / period if known else math.nan,
        "a_gaps_over_target_fraction": over("A"),
        "b_gaps_over_target_fraction": over("B"),
        "target_ratio": TARGET_RATIO,
        "meets_target": bool(ratio <= TARGET_RATIO) if not math.isnan(ratio) else None,
        # The same ratio from the server's own step intervals (no client noise in it).
        "server_ratio_b_p99_over_a_p50": _ratio(
            b.get("server_itl_p99_ms"), a.get("server_itl_p50_ms")
        ),
        # Phase A's own tail (server side): over IDLE_SPREAD_MAX the idle phase jittered.
        "server_idle_spread": _ratio(a.get("server_itl_p99_ms"), a.get("server_itl_p50_ms")),
    }


def _ratio(top: float | None, bottom: float | None) -> float:
    if top is None or not bottom or math.isnan(bottom):
        return math.nan
    return top / bottom
