"""A server's Prometheus metrics as a benchmark reads them: fetching the text, its histograms
and their quantiles, and the event-loop lag over one level."""

from __future__ import annotations

import math
import urllib.request
from typing import Any

LOOP_LAG = "vlm_event_loop_lag_seconds"


def scrape_loop_lag(url: str | None) -> dict[float, float] | None:
    """The loop-lag histogram at ``url`` (see `scrape_histogram`)."""
    return scrape_histogram(url, LOOP_LAG)


def fetch_metrics(url: str | None) -> str | None:
    """The Prometheus text at ``url``; None when there is no URL or it cannot be read."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def histogram_from_text(text: str, name: str) -> dict[float, float] | None:
    """Histogram ``name`` in Prometheus ``text`` as {upper bound: cumulative count}, the +Inf
    bucket included; None when it is not there."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"{name}_bucket"
    }
    return buckets or None


def scrape_histogram(url: str | None, name: str) -> dict[float, float] | None:
    """Histogram ``name`` at ``url`` (see `histogram_from_text`); None when there is no URL or
    it cannot be read."""
    text = fetch_metrics(url)
    return None if text is None else histogram_from_text(text, name)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """The ``q`` quantile (0..1) of cumulative ``buckets``, interpolated linearly inside its
    bucket as Prometheus does (the +Inf bucket answers its lower bound); NaN when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def loop_lag_summary(
    before: dict[float, float] | None, after: dict[float, float] | None
) -> dict[str, Any]:
    """Loop-lag p50 / p99 (ms) and sample count over a level: the histogram's growth."""
    if before is None or after is None:
        return {"loop_lag_samples": 0, "loop_lag_p50_ms": None, "loop_lag_p99_ms": None}
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    return {
        "loop_lag_samples": int(delta[max(delta)]),
        "loop_lag_p50_ms": histogram_quantile(0.50, delta) * 1e3,
        "loop_lag_p99_ms": histogram_quantile(0.99, delta) * 1e3,
    }
