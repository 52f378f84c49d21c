"""What the load generator's client saw of one request (`run_one` issues it), and a level's
summary of those records: counts, latency percentiles, rates and goodput."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from bench.http_client import HttpLoadClient
from bench.load_scenarios import Workload
from vlm_server.client import AsyncVisionLanguageClient
from vlm_server.client import types as t

Client = AsyncVisionLanguageClient | HttpLoadClient


@dataclass
class Record:
    """What the client saw of one request (seconds), plus the server's own metrics."""

    ok: bool
    error: str = ""
    streamed: bool = False
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive deltas
    output_tokens: int = 0
    objects: int = 0
    finish_reason: str = ""
    server: t.Metrics | None = None


async def run_one(
    client: Client,
    wl: Workload,
    image: bytes,
    seed: int,
    t0: float,
    timeout: float,
) -> Record:
    """Issue one request; latencies count from ``t0`` (perf_counter seconds)."""
    settings: dict[str, Any] = {"temperature": 0.0, "seed": seed}
    if wl.max_tokens is not None:
        settings["max_tokens"] = wl.max_tokens
    if wl.max_objects is not None:
        settings["max_objects"] = wl.max_objects
    try:
        if wl.streamed:
            if wl.rpc == "query":
                extra: dict[str, Any] = {"reasoning": True} if wl.reasoning else {}
                if wl.regex is not None:
                    extra["regex"] = wl.regex
                events = client.query_stream(
                    image, wl.question, timeout=timeout, **extra, **settings
                )
            else:
                events = client.caption_stream(image, "normal", timeout=timeout, **settings)
            first: float | None = None
            last = 0.0
            gaps: list[float] = []
            result: t.TextResult | None = None
            async for event in events:
                now = time.perf_counter()
                if isinstance(event, t.TextDelta):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                else:
                    result = event
            end = time.perf_counter()
            if result is None:
                return Record(False, "NO_RESULT", e2e_s=end - t0)
            return Record(
                True,
                streamed=True,
                ttft_s=(first if first is not None else end) - t0,
                e2e_s=end - t0,
                gaps_s=gaps,
                output_tokens=result.metrics.output_tokens,
                finish_reason=result.finish_reason,
                server=result.metrics,
            )
        method = {"point": client.point, "detect": client.detect, "segment": client.segment}[wl.rpc]
        res = await method(image, "object", timeout=timeout, **settings)
        end = time.perf_counter()
        objects = (
            len(res.points)
            if isinstance(res, t.PointResult)
            else len(res.boxes)
            if isinstance(res, t.DetectResult)
            else len(res.polygons)
        )
        return Record(
            True,
            ttft_s=end - t0,
            e2e_s=end - t0,
            output_tokens=res.metrics.output_tokens,
            objects=objects,
            finish_reason=res.finish_reason,
            server=res.metrics,
        )
    except t.VlmError as err:
        return Record(False, err.code.name, e2e_s=time.perf_counter() - t0)
    except (grpc.RpcError, aiohttp.ClientError, OSError) as err:  # OSError: TimeoutError too
        return Record(False, type(err).__name__, e2e_s=time.perf_counter() - t0)


# ---- statistics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist_ms(values: Sequence[float], prefix: str) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    out = {f"{prefix}_p{q}_ms": percentile(ms, q) for q in (50, 90, 99)}
    out[f"{prefix}_mean_ms"] = sum(ms) / len(ms) if ms else float("nan")
    return out


def summarize(records: Sequence[Record], wall_s: float, slo_ms: float) -> dict[str, Any]:
    """Aggregate one level: counts, latency percentiles (ms), rates and goodput."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if not r.ok)
    tokens = [r.output_tokens for r in ok]
    # Time per output token after the first: the decode pace one stream sees.
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.streamed and r.output_tokens > 1
    ]
    within = sum(1 for r in ok if r.e2e_s * 1e3 <= slo_ms)
    servers = [r.server for r in ok if r.server is not None]
    wall = max(wall_s, 1e-9)
    row: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(errors),
        "wall_s": wall_s,
        "req_per_s": len(ok) / wall,
        "tokens_per_s": sum(tokens) / wall,
        "output_tokens_total": sum(tokens),
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else float("nan"),
        "output_tokens_min": min(tokens) if tokens else 0,
        "output_tokens_max": max(tokens) if tokens else 0,
        "objects_mean": sum(r.objects for r in ok) / len(ok) if ok else float("nan"),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "slo_ms": slo_ms,
        "goodput_req_per_s": within / wall,
        "slo_attainment": within / len(records) if records else float("nan"),
    }
    row |= _dist_ms([r.ttft_s for r in ok], "ttft")
    row |= _dist_ms([g for r in ok for g in r.gaps_s], "itl")
    row |= _dist_ms(tpot, "tpot")
    row |= _dist_ms([r.e2e_s for r in ok], "e2e")
    row["server_queue_wait_p50_ms"] = percentile([m.queue_wait_ms for m in servers], 50)
    row["server_ttft_p50_ms"] = percentile([m.time_to_first_token_ms for m in servers], 50)
    row["server_prefill_p50_ms"] = percentile([m.prefill_ms for m in servers], 50)
    row["server_intake_p50_ms"] = percentile([m.intake_ms for m in servers], 50)
    row["server_prefix_wait_p50_ms"] = percentile([m.prefix_wait_ms for m in servers], 50)
    row["server_total_p50_ms"] = percentile([m.total_ms for m in servers], 50)
    row["cached_tokens_mean"] = (
        sum(m.cached_tokens for m in servers) / len(servers) if servers else float("nan")
    )
    return row
