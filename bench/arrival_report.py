"""The arrivals benchmark's output (`bench.arrival_itl`): the printed table and the figure
(gap CDFs of both phases, and every gap over time with the arrivals marked)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from bench.arrival_timeline import PHASE_NAMES, PHASES, TARGET_RATIO, Timeline
from bench.targets import IDLE_SPREAD_MAX


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(result: dict[str, Any], title: str) -> None:
    print(f"\n{title}\n(inter-token gaps of the caption streams, ms, client side)")
    print(
        f"{'phase':<12} {'gaps':>7} {'itl50':>7} {'itl90':>7} {'itl99':>7} {'max':>8} "
        f"{'step50':>7} {'batch':>6} {'tok/str':>7} {'tok/dlt':>7} {'lag99':>6}"
    )
    for p in PHASES:
        r = result["phases"][p]
        print(
            f"{PHASE_NAMES[p]:<12} {r['gaps']:>7} {_fmt(r['itl_p50_ms'], '.2f'):>7} "
            f"{_fmt(r['itl_p90_ms'], '.2f'):>7} {_fmt(r['itl_p99_ms'], '.2f'):>7} "
            f"{_fmt(r['itl_max_ms'], '.2f'):>8} {_fmt(r['server_step_p50_ms'], '.2f'):>7} "
            f"{_fmt(r['server_batch_p50'], '.0f'):>6} {_fmt(r['output_tokens_mean']):>7} "
            f"{_fmt(r['tokens_per_delta'], '.2f'):>7} {_fmt(r['client_loop_lag_p99_ms'], '.2f'):>6}"
        )
    a = result["arrivals"]
    print(
        f"arrivals: offered {_fmt(a['offered_req_per_s'], '.2f')} req/s, achieved "
        f"{_fmt(a['achieved_req_per_s'], '.2f')} req/s, ok {a['ok']}/{a['requests']}, "
        f"peak in flight {a['peak_in_flight']}, e2e p50 {_fmt(a['e2e_p50_ms'])} "
        f"p99 {_fmt(a['e2e_p99_ms'])}, ttft p50 {_fmt(a['ttft_p50_ms'])} ms"
    )
    v = result["verdict"]
    met = {True: "met", False: "NOT met", None: "unknown"}[v["meets_target"]]
    print(
        f"decode period (A gap p50) {_fmt(v['decode_period_ms'], '.2f')} ms, server step p50 "
        f"{_fmt(v['server_step_period_ms'], '.2f')} ms at batch {_fmt(v['batch_size'], '.0f')}"
    )
    print(
        f"target: B gap p99 / A gap p50 = {_fmt(v['ratio_b_p99_over_a_p50'], '.2f')} "
        f"<= {TARGET_RATIO:g}: {met}; gaps over {TARGET_RATIO:g}x A p50: A "
        f"{_fmt(v['a_gaps_over_target_fraction'] * 100, '.2f')}%, B "
        f"{_fmt(v['b_gaps_over_target_fraction'] * 100, '.2f')}%"
    )
    a_srv, b_srv = result["phases"]["A"], result["phases"]["B"]
    print(
        f"server side (step intervals): A p50 / p99 {_fmt(a_srv['server_itl_p50_ms'], '.2f')} / "
        f"{_fmt(a_srv['server_itl_p99_ms'], '.2f')} ms, B p50 / p99 "
        f"{_fmt(b_srv['server_itl_p50_ms'], '.2f')} / "
        f"{_fmt(b_srv['server_itl_p99_ms'], '.2f')} ms; B p99 / A p50 = "
        f"{_fmt(v['server_ratio_b_p99_over_a_p50'], '.2f')}"
    )
    spread = v.get("server_idle_spread", math.nan)
    if spread > IDLE_SPREAD_MAX:
        print(
            f"warning: phase A's own p99 / p50 is {spread:.2f} (over {IDLE_SPREAD_MAX:g}): the "
            "idle phase jittered, so the ratio overstates the engine's (a host stall?)"
        )
    if a_srv.get("events_delay_p99_ms") is not None:
        print(
            f"engine events to the server's streams: A p50 / p99 "
            f"{_fmt(a_srv['events_delay_p50_ms'], '.2f')} / "
            f"{_fmt(a_srv['events_delay_p99_ms'], '.2f')} ms, B p50 / p99 "
            f"{_fmt(b_srv.get('events_delay_p50_ms'), '.2f')} / "
            f"{_fmt(b_srv.get('events_delay_p99_ms'), '.2f')} ms"
        )


def plot(tl: Timeline, result: dict[str, Any], path: Path, title: str) -> bool:
    """Gap CDFs of both phases, and every gap over time with the arrivals marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    period = result["verdict"]["decode_period_ms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = {"A": "tab:blue", "B": "tab:orange"}
    for p in PHASES:
        ms = sorted(g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == p)
        if not ms:
            continue
        n = len(ms)
        left.plot(ms, [(i + 1) / n for i in range(n)], color=colours[p], label=PHASE_NAMES[p])
        at = [g.end - tl.start for g in tl.gaps if tl.phase(g.end) == p]
        gaps = [g.seconds * 1e3 for g in tl.gaps if tl.phase(g.end) == p]
        right.scatter(at, gaps, s=2, color=colours[p], alpha=0.4, label=PHASE_NAMES[p])
    if period is not None and not math.isnan(period):
        left.axvline(period, color="grey", ls=":", label=f"A p50 {period:.1f} ms")
        left.axvline(TARGET_RATIO * period, color="red", ls="--", label=f"{TARGET_RATIO:g}x A p50")
        right.axhline(TARGET_RATIO * period, color="red", ls="--", lw=0.8)
    left.set_xscale("log")
    left.set_xlabel("inter-token gap (ms)")
    left.set_ylabel("fraction of gaps")
    left.set_ylim(0.0, 1.0)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    left.set_title("gap CDF", fontsize=9)
    for at in tl.arrivals:
        right.axvline(at - tl.start, color="green", alpha=0.15, lw=0.5)
    right.set_yscale("log")
    right.set_xlabel(f"seconds since the streams started (green: arrivals, {len(tl.arrivals)})")
    right.set_ylabel("gap (ms)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, markerscale=4)
    right.set_title("gaps over time", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
