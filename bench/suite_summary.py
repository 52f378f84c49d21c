"""Short summary of a benchmark suite run: step status, then headline figures against the
targets (moondream2 size, one H100; see the project's anchors).

    python -m bench.suite_summary RESULTS_DIR

Reads ``suite_steps.tsv`` (name, status, seconds; written by run_gpu_suite.sh) and whatever
result JSONs are present; a missing or unreadable file just leaves its lines out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = tuple[str, float | None, str, str]  # figure, value, unit, target text


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _find(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def step_rows(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for streams, target in ((1, "<= 1.5"), (8, ""), (32, "<= 3.5")):
        r = _find(d["rows"], streams=streams, depth=2)
        if r:
            out.append(
                (f"decode period, {streams} stream(s), pipelined", r["period_ms"], "ms", target)
            )
            out.append(
                (f"GPU idle per step, {streams} stream(s)", r["gpu_idle_ms"], "ms", "< 0.05")
            )
    return out


def sampling_rows(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for r in d["rows"]:
        if "mask_sample_graph_ms" in r:
            out.append(
                (f"mask + sample, graphed, batch {r['batch']}", r["mask_sample_graph_ms"], "ms", "")
            )
    return out


def load_rows(d: dict[str, Any]) -> list[Row]:
    rows = d["rows"]
    out: list[Row] = []
    spec: list[tuple[dict[str, Any], str, str, str, str]] = [
        (
            {"scenario": "query3/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "query ~3 tokens, unique 800x600, c=1, p50",
            "ms",
            "<= 30",
        ),
        (
            {"scenario": "query3/800x600/unique", "concurrency": 64},
            "req_per_s",
            "query ~3 tokens, unique 800x600, c=64",
            "req/s",
            ">= 60",
        ),
        (
            {"scenario": "query3/800x600/unique", "concurrency": 64},
            "e2e_p50_ms",
            "query ~3 tokens, unique 800x600, c=64, p50",
            "ms",
            "",
        ),
        (
            {"scenario": "query30/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "query ~30 tokens, c=1, p50",
            "ms",
            "",
        ),
        (
            {"scenario": "query30/800x600/unique", "concurrency": 64},
            "req_per_s",
            "query ~30 tokens, c=64",
            "req/s",
            "",
        ),
        (
            {"scenario": "caption64/800x600/unique", "concurrency": 1},
            "ttft_p50_ms",
            "caption, first streamed token, c=1, p50",
            "ms",
            "<= 25",
        ),
        (
            {"scenario": "caption64/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "caption 64 tokens, c=1, p50",
            "ms",
            "<= 130",
        ),
        (
            {"scenario": "detect5/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "detect (max 5 objects), c=1, p50",
            "ms",
            "<= 50",
        ),
        (
            {"scenario": "point5/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "point (max 5 objects), c=1, p50",
            "ms",
            "",
        ),
        (
            {"scenario": "segment/800x600/unique", "concurrency": 1},
            "e2e_p50_ms",
            "segment, c=1, p50",
            "ms",
            "",
        ),
        (
            {"scenario": "query3/800x600/repeated", "concurrency": 1},
            "e2e_p50_ms",
            "query ~3 tokens, repeated image, c=1, p50",
            "ms",
            "",
        ),
        (
            {"scenario": "query3/4000x3000/unique", "concurrency": 1},
            "e2e_p50_ms",
            "query ~3 tokens, unique 12 MP, c=1, p50",
            "ms",
            "",
        ),
    ]
    for match, key, label, unit, target in spec:
        r = _find(rows, **match)
        if r:
            tok = r.get("output_tokens_mean")
            objs = r.get("objects_mean")
            note = (
                f" [{objs:.1f} obj]"
                if r["workload"] in ("point5", "detect5") and objs is not None
                else f" [{tok:.1f} tok]"
                if tok is not None
                else ""
            )
            out.append((label + note, r.get(key), unit, target))
    return out


def hf_rows(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for r in d.get("dynamic", []):
        if "decode_step_ms" in r:
            out.append(
                (
                    f"transformers dynamic cache, batch {r['batch']}, per step",
                    r["decode_step_ms"],
                    "ms",
                    "",
                )
            )
    kind = "static compiled" if d.get("auto_compile") else "static (not compiled)"
    for r in d.get("static", []):
        if "ms_per_token" in r:
            out.append(
                (
                    f"transformers {kind}, batch {r['batch']}, per token",
                    r["ms_per_token"],
                    "ms",
                    f"warm-up {r['warmup_s']:.0f} s",
                )
            )
    cb = d.get("batch") or {}
    if cb.get("status") == "ok":
        out.append(
            (
                f"transformers generate_batch {cb['requests']} x {cb['new_tokens']}",
                cb["tokens_per_s"],
                "tok/s",
                f"{cb['total_s']:.1f} s",
            )
        )
    elif cb:
        out.append(("transformers generate_batch", None, "", cb.get("status", "?")))
    return out


def image_rows(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for size in ("800x600", "4000x3000"):
        for fmt in ("jpeg", "png"):
            one = _find(d["rows"], size=size, format=fmt, threads=1)
            if one:
                out.append(
                    (f"image prepare {size} {fmt}, 1 thread", one["ms_per_image"], "ms/img", "")
                )
            top = [r for r in d["rows"] if r["size"] == size and r["format"] == fmt]
            if top:
                best = max(top, key=lambda r: r["images_per_s"])
                out.append(
                    (
                        f"image prepare {size} {fmt}, {best['threads']} threads",
                        best["images_per_s"],
                        "img/s",
                        "",
                    )
                )
    return out


SOURCES: list[tuple[str, str, Callable[[dict[str, Any]], list[Row]]]] = [
    ("step_bench.json", "decode steps (engine)", step_rows),
    ("sampling_bench.json", "sampling", sampling_rows),
    ("load_gen.json", "gRPC end to end (client side)", load_rows),
    ("image_bench.json", "image pipeline (CPU)", image_rows),
    ("hf_baseline.json", "transformers baselines", hf_rows),
]


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    args = ap.parse_args(argv)
    steps = args.results / "suite_steps.tsv"
    if steps.exists():
        print(f"\n{'step':<16} {'status':<22} {'seconds':>8}")
        for line in steps.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                print(f"{parts[0]:<16} {parts[1]:<22} {parts[2]:>8}")
    for filename, title, rows_of in SOURCES:
        data = _load(args.results / filename)
        if data is None:
            continue
        try:
            rows = rows_of(data)
        except (KeyError, TypeError, ValueError) as err:
            print(f"\n{title}: cannot summarize {filename} ({type(err).__name__}: {err})")
            continue
        if not rows:
            continue
        print(f"\n{title} ({data.get('device', '?')})")
        for label, value, unit, target in rows:
            print(f"  {label:<58} {_fmt(value):>9} {unit:<6} {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
