"""The load generator's output: portable settings, strict JSON, the printed table, the two
plots, and the device's name."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_server.client import AsyncVisionLanguageClient
from vlm_server.client import types as t


def portable(values: Sequence[str]) -> list[str]:
    """Command-line values with absolute paths cut to their last part: results name no
    machine's folders."""
    return [Path(v).name if v.startswith("/") else v for v in values]


def portable_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's settings for its results: paths as `portable` gives them."""
    out: dict[str, Any] = {}
    for k, v in vars(args).items():
        if isinstance(v, Path) or (isinstance(v, str) and v.startswith("/")):
            v = Path(v).name
        out[k] = v
    return out


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


TABLE_HEAD = (
    f"{'scenario':<30} {'door':>5} {'level':>9} {'ok/n':>9} {'req/s':>7} {'tok/s':>8} "
    f"{'ttft50':>7} {'e2e50':>7} {'e2e90':>7} {'e2e99':>7} {'itl50':>6} "
    f"{'tok':>5} {'good/s':>7} {'lag50':>6} {'lag99':>6}"
)


def _table_line(r: dict[str, Any]) -> str:
    return (
        f"{r['scenario']:<30} {r.get('door', 'grpc'):>5} {r['level']:>9} "
        f"{str(r['ok']) + '/' + str(r['requests']):>9} "
        f"{_fmt(r['req_per_s'], '.2f'):>7} {_fmt(r['tokens_per_s']):>8} "
        f"{_fmt(r['ttft_p50_ms']):>7} {_fmt(r['e2e_p50_ms']):>7} "
        f"{_fmt(r['e2e_p90_ms']):>7} {_fmt(r['e2e_p99_ms']):>7} "
        f"{_fmt(r['itl_p50_ms'], '.2f'):>6} {_fmt(r['output_tokens_mean']):>5} "
        f"{_fmt(r['goodput_req_per_s'], '.2f'):>7} {_fmt(r.get('loop_lag_p50_ms')):>6} "
        f"{_fmt(r.get('loop_lag_p99_ms')):>6}"
    )


def print_table(rows: Sequence[dict[str, Any]], title: str) -> None:
    print(
        f"\n{title}\n(latencies ms, client side; tok = mean output tokens; good/s = requests "
        f"within the objective per second; lag = the server's event-loop lag, ms)"
    )
    print(TABLE_HEAD)
    for r in rows:
        print(_table_line(r))


def series(row: dict[str, Any]) -> str:
    """A plot line's name: the scenario, and the door unless it is gRPC."""
    door = row.get("door", "grpc")
    return row["scenario"] if door == "grpc" else f"{row['scenario']} [{door}]"


def plot(rows: Sequence[dict[str, Any]], out: Path, tag: str, title: str) -> list[Path]:
    """Latency percentiles by concurrency, and throughput against latency; the PNG paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    scenarios = list(dict.fromkeys(series(r) for r in rows))
    paths = []
    closed = [s for s in scenarios if any(series(r) == s and r["loop"] == "closed" for r in rows)]
    if closed:
        cols = min(3, len(closed))
        nrows = math.ceil(len(closed) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
        for ax, s in zip(axes.flat, closed, strict=False):
            pts = sorted(
                (r["concurrency"], r) for r in rows if series(r) == s and r["loop"] == "closed"
            )
            xs = [c for c, _ in pts]
            for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
                ax.plot(xs, [r[f"e2e_p{q}_ms"] for _, r in pts], style, label=f"e2e p{q}")
            ax.plot(xs, [r["ttft_p50_ms"] for _, r in pts], "x-", label="ttft p50")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_title(s, fontsize=9)
            ax.set_xlabel("concurrency")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(closed) :]:
            ax.set_visible(False)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"latency by concurrency - {title}", fontsize=10)
        fig.tight_layout()
        path = out / f"{tag}_latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in scenarios:
        colour = None
        # One line per loop kind, in load order, each point labelled with its level.
        for loop, key, style in (("closed", "concurrency", "o-"), ("open", "rate", "s--")):
            pts = sorted(
                (r for r in rows if series(r) == s and r["loop"] == loop),
                key=lambda r, k=key: r[k],
            )
            if not pts:
                continue
            line = ax.plot(
                [r["req_per_s"] for r in pts],
                [r["e2e_p50_ms"] for r in pts],
                style,
                color=colour,
                label=f"{s} ({'closed' if loop == 'closed' else 'open'} loop)",
            )
            colour = line[0].get_color()
            for r in pts:
                ax.annotate(
                    r["level"],
                    (r["req_per_s"], r["e2e_p50_ms"]),
                    fontsize=6,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("end-to-end latency p50 (ms)")
    ax.set_yscale("log")
    ax.set_title(f"throughput vs latency - {title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{tag}_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def device_name(info: t.ModelInfo | None, local: bool) -> str:
    """The GPU's marketing name when the server runs here on CUDA, else the server's device."""
    if info is None:
        return "unknown"
    if info.device.startswith("cuda") and local:
        with contextlib.suppress(Exception):
            import torch

            index = int(info.device.split(":")[1]) if ":" in info.device else 0
            return torch.cuda.get_device_name(index)
    return "cpu" if info.device.startswith("cpu") else info.device


async def _model_info(target: str) -> t.ModelInfo | None:
    async with AsyncVisionLanguageClient(target, timeout=10) as client:
        try:
            return await client.model_info()
        except t.VlmError:
            return None
