"""A CUDA graph's replays, kernel by kernel, from a profiler trace: each kernel's kind, the
time per kind, and the idle time between kernels by the kinds it lies between.

`profiled_replays` replays a graph under the profiler, waiting for each replay before the
next launch, so a replay's kernels are those after its launch and before the next one
(`replays_of_trace`); `summarize` gives the medians over replays of `replay_stats`.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (pattern on the kernel's name, kind), the first that matches; others keep their name's
# first 40 characters.
KINDS: tuple[tuple[str, str], ...] = (
    (r"_paged_(decode|tile)_kernel|flash|fmha|attention|sdpa|cudnn", "attention"),
    (r"_rope_store_kernel", "rope + KV store"),
    (r"layernorm|layer_norm|_norm", "norms"),
    (r"_skinny_kernel|_split_sum_kernel", "fused decode products"),
    (r"_quant_gemm_kernel|_quant_rows_kernel", "quantized products"),
    (r"_route_kernel|_align_kernel|topk|sort", "expert routing"),
    (r"_up_(reduce_)?kernel", "experts fc1"),
    (r"_down_(reduce_)?kernel", "experts fc2"),
    (r"_combine_kernel", "combines (experts, attention splits)"),
    (r"_logits_kernel|_scale_kernel", "tau"),
    (r"_shrink|_expand", "adapters"),
    (r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitKreduce", "cuBLAS products"),
    (r"elementwise|reduce_kernel|index|gather|scatter|copy|fill|cat_|softmax", "torch ops"),
    (r"^Memcpy|^Memset", "copies"),
)
_COMPILED = [(re.compile(p, re.IGNORECASE), kind) for p, kind in KINDS]
_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    """The kind of a kernel named ``name`` (`KINDS`)."""
    for pattern, kind in _COMPILED:
        if pattern.search(name):
            return kind
    return name[:40]


@dataclass(frozen=True)
class Kernel:
    """One kernel (or copy) on the device: name, start and length in microseconds."""

    name: str
    start: float
    dur: float

    @property
    def end(self) -> float:
        return self.start + self.dur


# A graph launch's API call, as the trace names it (some versions add a "_vNNNNN" suffix).
_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")


def replays_of_trace(trace: dict[str, Any]) -> list[list[Kernel]]:
    """A profiler trace (Chrome trace JSON) -> each graph launch's kernels in start order:
    a kernel belongs to the last launch before it (replays were waited for one by one, so
    none overlaps the next launch). Kernels before the first launch are dropped. A trace
    without launch calls groups kernels by their launch's correlation id instead."""
    events = trace.get("traceEvents", [])
    launches = sorted(
        float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and _LAUNCH.match(str(e.get("name")))
    )
    groups: dict[object, list[Kernel]] = defaultdict(list)
    for e in events:
        if e.get("cat") not in _GPU_CATEGORIES or "dur" not in e:
            continue
        if launches:
            key: object = _last_at_or_before(launches, float(e["ts"]))
        else:
            key = e.get("args", {}).get("correlation", -1)
        if key != -1:
            groups[key].append(Kernel(str(e["name"]), float(e["ts"]), float(e["dur"])))
    ordered = sorted(groups.values(), key=lambda g: min(k.start for k in g))
    return [sorted(g, key=lambda k: k.start) for g in ordered]


def _last_at_or_before(sorted_ts: list[float], t: float) -> int:
    lo, hi = 0, len(sorted_ts)
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_ts[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def replay_stats(kernels: list[Kernel]) -> dict[str, Any]:
    """One replay's span, busy and idle microseconds, its time and count per kind, and its
    idle time per transition ("kind before -> kind after"). Overlapping kernels (two streams
    inside the graph) count their union as busy and no gap between them."""
    span = kernels[-1].end - kernels[0].start if kernels else 0.0
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    idle_at: dict[str, float] = defaultdict(float)
    busy, reach = 0.0, kernels[0].start if kernels else 0.0
    prev: Kernel | None = None
    for k in kernels:
        entry = by_kind[kind_of(k.name)]
        entry[0] += 1
        entry[1] += k.dur
        if k.start > reach and prev is not None:
            idle_at[f"{kind_of(prev.name)} -> {kind_of(k.name)}"] += k.start - reach
        busy += max(0.0, k.end - max(k.start, reach))
        if k.end > reach:
            reach, prev = k.end, k
    return {
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "kernels": len(kernels),
        "kinds": {kind: {"count": int(c), "us": us} for kind, (c, us) in by_kind.items()},
        "idle_at": dict(idle_at),
    }


def summarize(replays: list[list[Kernel]]) -> dict[str, Any]:
    """Medians over replays of `replay_stats` (each kind's and transition's median, zero
    where a replay lacks it)."""
    stats = [replay_stats(r) for r in replays]
    if not stats:
        raise ValueError("no replay's kernels in the trace")

    def med(values: list[float]) -> float:
        return statistics.median(values)

    kinds = sorted({k for s in stats for k in s["kinds"]})
    where = sorted({t for s in stats for t in s["idle_at"]})
    out = {key: med([s[key] for s in stats]) for key in ("span_us", "busy_us", "idle_us")}
    out["kernels"] = med([s["kernels"] for s in stats])
    out["replays"] = len(stats)
    out["kinds"] = {
        k: {
            "count": med([s["kinds"].get(k, {"count": 0})["count"] for s in stats]),
            "us": med([s["kinds"].get(k, {"us": 0.0})["us"] for s in stats]),
        }
        for k in kinds
    }
    idle = {t: med([s["idle_at"].get(t, 0.0) for s in stats]) for t in where}
    out["idle_at"] = dict(sorted(idle.items(), key=lambda kv: -kv[1]))
    return out


def profiled_replays(replay: Callable[[], object], stream: Any, replays: int) -> list[list[Kernel]]:
    """Each of ``replays`` calls of ``replay`` (a graph replay on ``stream``, a CUDA stream),
    profiled: its kernels in start order. Three unprofiled calls first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.cuda.stream(stream):
        for _ in range(3):
            replay()
    stream.synchronize()  # the profile starts on a quiet device
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            with torch.cuda.stream(stream):
                replay()
            stream.synchronize()  # a replay's kernels end before the next launch
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return replays_of_trace(trace)
