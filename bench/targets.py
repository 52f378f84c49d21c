"""Figures of record: one row per serving target, built from the benchmarks' JSON outputs and
merged by name into ``bench/results/<GPU>/targets.json`` (bench/targets.sh runs the benchmarks).

    python -m bench.targets collect RAW_DIR --targets FILE --commit SHA [--prefix md2]
    python -m bench.targets show FILE
    python -m bench.targets gpu-folder "NVIDIA H100 80GB HBM3"      # prints NVIDIA_H100

``collect`` reads whichever of these RAW_DIR holds and merges their rows into FILE (a partial
run updates only its own rows; the others stay as they were):

    step_bench.json    python -m bench.step_bench         decode period per stream count
    load_gen.json      python -m bench.load_gen           query3 / caption128 over gRPC
    image_bench.json   python -m bench.image_bench        host CPU and SM time per picture
    tower.json         python -m bench.tower_probe --json  vision tower, bf16 and FP8
    arrival_itl.json   python -m bench.arrival_itl        step gaps while new images arrive
    scaleout.json      python -m bench.scaleout           replicas on Ray Serve (vlm cluster)
    lora_bench.json    python -m bench.lora_bench         finetune adapters: period, load gaps
    bulk_bench.json    python -m bench.bulk_bench         vlm batch, interactive under a batch
    quant_numerics.json python -m bench.quant_numerics    int8/int4 logits against bf16

A row is ``{"name", "value", "unit", "target", "met", "commit", "flags"}``: ``target`` is a
bound as text ("<= 30", ">= 60") or null where none is stated; ``met`` says whether the value
is within it (null without a bound or a value); ``commit`` is the tree measured; ``flags`` are
the ``vlm serve`` flags the figure stands for (load and arrival rows: the spawned server's,
``--model`` left out; image and tower rows: the flags that select the path measured).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

# Name (after the model prefix) -> unit and bound, in the order targets.json lists them.
TARGETS: dict[str, tuple[str, str | None]] = {
    "query3.unique.c1.p50_ms": ("ms", "<= 25"),
    "reasoning.c1.p50_ms": ("ms", None),
    "query3.unique.c64.req_s": ("req/s", ">= 65"),
    "query3.repeated.c64.req_s": ("req/s", ">= 500"),
    "caption128.unique.c32.tok_s": ("tok/s", ">= 4000"),
    # 32 streamed captions, each on a new picture: first token and streamed-chunk gaps, as
    # the client sees them (first tokens fast under load without losing the other two).
    "caption128.unique.c32.ttft_p50_ms": ("ms", "<= 150"),
    "caption128.unique.c32.gap_p99_ms": ("ms", "<= 10"),
    "segment.unique.c1.p50_ms": ("ms", None),
    "segment.unique.c16.req_s": ("req/s", None),
    # Process start to gRPC health SERVING, default flags (load_gen --spawn).
    "startup_s": ("s", "<= 30"),
    "query3.unique.c64.req_s_24gb": ("req/s", None),
    "arrivals.s16.r20.step_gap_ratio": ("x", "<= 2"),
    "decode.period_ms.s1": ("ms", "<= 1.30"),
    "decode.period_ms.s32": ("ms", "<= 2.90"),
    # Moondream 3 with its experts in bf16 (step_bench of a bf16-expert checkpoint).
    "bf16.decode.period_ms.s1": ("ms", None),
    # The bandwidth floor of those steps (bench/decode_floor.py), reported beside them.
    "decode.floor_ms.s1": ("ms", None),
    "decode.floor_ms.s32": ("ms", None),
    "image.800x600.host_cpu_ms": ("ms", "<= 3"),
    "image.800x600.gpu_sm_ms": ("ms", "<= 1"),
    "image.4000x3000.host_cpu_ms": ("ms", "<= 45"),
    "image.4000x3000.gpu_sm_ms": ("ms", "<= 3"),
    "tower.crops9.bf16_ms": ("ms", "<= 10.5"),
    "tower.crops9.fp8_ms": ("ms", "<= 11"),
    "scaleout.query3.unique.c128.speedup_2gpu": ("x", ">= 1.9"),
    "scaleout.query3.affinity.hit_rate": ("", ">= 0.9"),
    "scaleout.query3.affinity.speedup_2gpu": ("x", ">= 1.9"),
    "scaleout.query3.unique.c1.p50_ratio": ("x", "<= 1.10"),
    # Past two GPUs (bench.scaleout --replicas 1 2 4 8): 64 clients per replica.
    "scaleout.query3.unique.c256.speedup_4gpu": ("x", ">= 3.8"),
    "scaleout.query3.unique.c512.speedup_8gpu": ("x", ">= 7.4"),
    "scaleout.query3.affinity.hit_rate_8gpu": ("", ">= 0.9"),
    # Finetune adapters: the decode period of 32 captions over 8 rank-32 adapters over that
    # of a server without adapters; the step-gap p99 while new adapters load over the p50
    # before (16 captions streaming).
    "lora8.period_ratio.s32": ("x", "<= 1.15"),
    "lora.load_gap_ratio": ("x", "<= 1.1"),
    # Bulk work (bench/bulk_bench.py): `vlm batch` against the online server at 64 clients,
    # and one client's query3 p50 while a Batch API job runs, over the same server idle.
    "caption128.unique.c64.tok_s": ("tok/s", None),
    "batch.caption128.tok_s": ("tok/s", None),
    "batch.caption128.online_ratio": ("x", ">= 1"),
    "query3.unique.c1.p50_ms_idle_server": ("ms", None),
    "query3.unique.c1.p50_ms_under_batch": ("ms", None),
    "query3.under_batch.p50_ratio": ("x", "<= 1.25"),
    # Weight-only quantization against the 16-bit checkpoint (bench/quant_numerics.py): the
    # next-token logits' mean cosine and top-1 agreement over 64 prompts with pictures.
    "int8.logits_cosine": ("", None),
    "int4.logits_cosine": ("", None),
    "int8.top1_agreement": ("", None),
    "int4.top1_agreement": ("", None),
}

# Rows that stand for one family only (no other family's targets.json lists them).
FAMILY_ONLY: dict[str, str] = {"bf16.decode.period_ms.s1": "md3"}

# Figures of no model, named without a prefix, in results/<machine>/targets.json. The
# cluster's gateway with stand-in replicas (bench.gateway_bench, its default workers): 1.5
# times what 8 GPUs answer on repeated pictures (~1,000 req/s each).
PLAIN_TARGETS: dict[str, tuple[str, str | None]] = {
    "gateway.repeated.req_s_8stand_ins": ("req/s", ">= 12000"),
    "gateway.repeated.req_s_16stand_ins": ("req/s", ">= 12000"),
}

# Bounds of one model family where they differ from TARGETS' (Moondream 3: a 9B mixture of
# experts, about 2B parameters active per token).
FAMILY_BOUNDS: dict[str, dict[str, str | None]] = {
    "md3": {
        "query3.unique.c1.p50_ms": "<= 30",
        "query3.unique.c64.req_s": ">= 70",
        "decode.period_ms.s1": "<= 1.20",
        "decode.period_ms.s32": "<= 4.9",
        "bf16.decode.period_ms.s1": "<= 1.60",
        "segment.unique.c1.p50_ms": "<= 160",
        "segment.unique.c16.req_s": ">= 40",
        # Reported beside moondream2's, not bound.
        "caption128.unique.c32.tok_s": None,
        "caption128.unique.c32.ttft_p50_ms": None,
        "caption128.unique.c32.gap_p99_ms": None,
        "startup_s": None,
    },
}

# load_gen rows: (scenario, concurrency, key) -> row name.
LOAD_ROWS: dict[tuple[str, int, str], str] = {
    ("query3/800x600/unique", 1, "e2e_p50_ms"): "query3.unique.c1.p50_ms",
    ("reason64/800x600/unique", 1, "e2e_p50_ms"): "reasoning.c1.p50_ms",
    ("query3/800x600/unique", 64, "req_per_s"): "query3.unique.c64.req_s",
    ("query3/800x600/repeated", 64, "req_per_s"): "query3.repeated.c64.req_s",
    ("caption128/800x600/unique", 32, "tokens_per_s"): "caption128.unique.c32.tok_s",
    ("caption128/800x600/unique", 32, "ttft_p50_ms"): "caption128.unique.c32.ttft_p50_ms",
    ("caption128/800x600/unique", 32, "itl_p99_ms"): "caption128.unique.c32.gap_p99_ms",
    ("segment/800x600/unique", 1, "e2e_p50_ms"): "segment.unique.c1.p50_ms",
    ("segment/800x600/unique", 16, "req_per_s"): "segment.unique.c16.req_s",
}

# image_bench rows (one thread, JPEG, libvips resize): (size, key) -> row name.
IMAGE_ROWS: dict[tuple[str, str], str] = {
    ("800x600", "cpu_ms"): "image.800x600.host_cpu_ms",
    ("800x600", "sm_ms"): "image.800x600.gpu_sm_ms",
    ("4000x3000", "cpu_ms"): "image.4000x3000.host_cpu_ms",
    ("4000x3000", "sm_ms"): "image.4000x3000.gpu_sm_ms",
}

# The arrivals' phase A (captions only) is their ratio's baseline: its own step-gap p99 stays
# within this of its p50 on a quiet host (1.27-1.33 on an H100); above it the
# host stalled the scheduler in the idle phase too, and the ratio says more about the host.
IDLE_SPREAD_MAX = 1.6

_BOUND = re.compile(r"^\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")


def met(value: float | None, target: str | None) -> bool | None:
    """Whether ``value`` is within ``target`` ("<= X" or ">= X"); None without either."""
    if value is None or target is None or (isinstance(value, float) and math.isnan(value)):
        return None
    m = _BOUND.match(target)
    if m is None:
        raise ValueError(f"a target is '<= X' or '>= X', not {target!r}")
    bound = float(m.group(2))
    return value <= bound if m.group(1) == "<=" else value >= bound


def make_row(prefix: str, name: str, value: float | None, commit: str | None, flags: str) -> Row:
    """A row of ``prefix.name`` (``name`` alone for a figure of no model: ``prefix`` "");
    unit and bound from TARGETS (no bound for unknown names), the bound as FAMILY_BOUNDS
    overrides it for the prefix's family. A prefix of two parts (``md3.bf16``) names a
    variant of the family: its bounds are those of ``bf16.<name>``."""
    family, _, variant = prefix.partition(".")
    key = f"{variant}.{name}" if variant else name
    unit, target = (TARGETS if prefix else PLAIN_TARGETS).get(key, ("", None))
    target = FAMILY_BOUNDS.get(family, {}).get(key, target)
    if isinstance(value, float):
        value = round(value, 4) if math.isfinite(value) else None
    return {
        "name": f"{prefix}.{name}" if prefix else name,
        "value": value,
        "unit": unit,
        "target": target,
        "met": met(value, target),
        "commit": commit,
        "flags": flags,
    }


def server_flags(server_args: Sequence[str]) -> str:
    """A spawned server's flags as one string, ``--model`` and its value left out."""
    out: list[str] = []
    skip = False
    for arg in server_args:
        if skip:
            skip = False
            continue
        if arg == "--model":
            skip = True
            continue
        if arg.startswith("--model="):
            continue
        out.append(arg)
    return " ".join(out)


# ---- rows from each tool's output -------------------------------------------------------------


def step_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """The pipelined decode period per stream count (the deepest pipeline measured)."""
    rows = d.get("rows") or []
    # Of an A/B run (step_bench --fused-decode true false), the default setting's rows.
    rows = [r for r in rows if r.get("fused_decode", True)] or rows
    out: list[Row] = []
    for streams in sorted({r["streams"] for r in rows}):
        mine = [r for r in rows if r["streams"] == streams]
        r = max(mine, key=lambda r: r["depth"])
        out.append(make_row(prefix, f"decode.period_ms.s{streams}", r["period_ms"], commit, ""))
        if r.get("floor_ms") is not None:
            out.append(make_row(prefix, f"decode.floor_ms.s{streams}", r["floor_ms"], commit, ""))
    return out


def load_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """The load rows LOAD_ROWS names, measured through gRPC; levels with no request done
    are left out (no figure)."""
    flags = server_flags(d.get("server_args") or [])
    out: list[Row] = []
    if d.get("server_startup_s") is not None:
        out.append(make_row(prefix, "startup_s", d["server_startup_s"], commit, flags))
    for r in d.get("rows") or []:
        if r.get("door", "grpc") != "grpc" or not r.get("ok"):
            continue
        for (scenario, conc, key), name in LOAD_ROWS.items():
            if r.get("scenario") == scenario and r.get("concurrency") == conc:
                out.append(make_row(prefix, name, r.get(key), commit, flags))
    return out


def image_flags(d: dict[str, Any]) -> str:
    """The server flags of the image path image_bench measured."""
    if d.get("gpu_decode_min_pixels"):
        return (
            f"--image-gpu-decode-min-pixels {d['gpu_decode_min_pixels']} "
            f"--image-gpu-decoder {d.get('gpu_decoder') or 'auto'}"
        )
    return ""


def image_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """Host CPU and SM time per JPEG at one thread (libvips resize). A split run measures
    the server's share only, which is not the target's figure: it gives no rows."""
    if d.get("split"):
        return []
    flags = image_flags(d)
    out: list[Row] = []
    for (size, key), name in IMAGE_ROWS.items():
        for r in d.get("rows") or []:
            if (r["size"], r["format"], r["threads"], r.get("resize", "vips")) == (
                size,
                "jpeg",
                1,
                "vips",
            ):
                if r.get(key) is not None:
                    out.append(make_row(prefix, name, r[key], commit, flags))
                break
    return out


def tower_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """The whole vision tower per crop count, bf16 and with FP8 GEMMs (``--vision-fp8``)."""
    out: list[Row] = []
    for r in d.get("tower") or []:
        if r.get("mode") not in ("bf16", "fp8"):  # the deviation record, the probe's "before"
            continue
        flags = "--vision-fp8 true" if r["mode"] == "fp8" else ""
        name = f"tower.crops{r['crops']}.{r['mode']}_ms"
        out.append(make_row(prefix, name, r["ms"], commit, flags))
    return out


def arrival_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """The server's step gaps under arrivals: phase B's p99 over phase A's p50."""
    if not d.get("complete"):
        return []
    settings = d.get("settings") or {}
    value = (d.get("verdict") or {}).get("server_ratio_b_p99_over_a_p50")
    if value is None:
        return []
    name = f"arrivals.s{settings.get('streams')}.r{settings.get('rate'):g}.step_gap_ratio"
    row = make_row(prefix, name, value, commit, server_flags(d.get("server_args") or []))
    spread = (d.get("verdict") or {}).get("server_idle_spread")
    if spread is None:  # written before the verdict carried it: from phase A's own figures
        a = (d.get("phases") or {}).get("A") or {}
        p50, p99 = a.get("server_itl_p50_ms"), a.get("server_itl_p99_ms")
        spread = p99 / p50 if p50 and p99 is not None else None
    if spread is not None and spread > IDLE_SPREAD_MAX:  # recorded as measured, and said
        row["note"] = (
            f"phase A's own p99 / p50 was {spread:.2f} (over {IDLE_SPREAD_MAX:g}): the idle "
            "phase jittered; the ratio overstates the engine's"
        )
    return [row]


def scaleout_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """Replicas on Ray Serve: 2-GPU speedups, affinity hit rate, the cluster's c1 p50 ratio."""
    from bench.scaleout import rows  # it imports this module

    return rows(d, prefix, commit)


def lora_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """Finetune adapters: the period ratio (at the stream and adapter counts run) and the
    load gap ratio."""
    settings = d.get("settings") or {}
    if settings.get("rank") != 32:  # the rows stand for rank-32 adapters
        return []
    name = f"lora{settings.get('adapters')}.period_ratio.s{settings.get('streams')}"
    rows = [make_row(prefix, name, d.get("period_ratio"), commit, "")]
    gap = (d.get("load_gap") or {}).get("ratio")
    return [*rows, make_row(prefix, "lora.load_gap_ratio", gap, commit, "")]


def bulk_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """Bulk work: `vlm batch` and the online server's caption throughput, interactive latency
    under a Batch API job."""
    from bench.bulk_bench import rows  # it imports this module

    return rows(d, prefix, commit)


def numerics_rows(d: dict[str, Any], prefix: str, commit: str | None) -> list[Row]:
    """Quantized weights' logits against the 16-bit model's, per format."""
    out: list[Row] = []
    for name, f in d["formats"].items():
        flags = f"--weights {name}"
        out.append(make_row(prefix, f"{name}.logits_cosine", f["logits_cosine"], commit, flags))
        out.append(make_row(prefix, f"{name}.top1_agreement", f["top1_agreement"], commit, flags))
    return out


SOURCES = {
    "step_bench.json": step_rows,
    "load_gen.json": load_rows,
    "image_bench.json": image_rows,
    "tower.json": tower_rows,
    "arrival_itl.json": arrival_rows,
    "scaleout.json": scaleout_rows,
    "lora_bench.json": lora_rows,
    "bulk_bench.json": bulk_rows,
    "quant_numerics.json": numerics_rows,
}


def collect(raw: Path, prefix: str, commit: str | None, suffix: str = "") -> list[Row]:
    """The rows TARGETS names from every tool output in ``raw`` (missing or unreadable files
    give none; figures no target row names, such as other crop counts, are left out).
    ``suffix`` marks a run under other conditions (``_24gb``: a 24 GB memory cap): it is
    appended to each figure's name, and only names TARGETS lists so are kept."""
    rows: list[Row] = []
    for filename, build in SOURCES.items():
        path = raw / filename
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        try:
            built = build(data, prefix, commit)
            if suffix:
                built = [
                    make_row(prefix, r["name"].split(".", 1)[1] + suffix, r["value"], commit,
                             r["flags"])
                    for r in built
                ]  # fmt: skip
            rows += [r for r in built if r["name"].split(".", 1)[1] in TARGETS]
        except (KeyError, TypeError, ValueError) as err:
            print(f"targets: cannot read {path} ({type(err).__name__}: {err})", file=sys.stderr)
    return rows


# ---- targets.json ----------------------------------------------------------------------------


def _order(name: str) -> tuple[int, str]:
    keys = list(TARGETS)
    if name in PLAIN_TARGETS:  # a figure of no model: after the models'
        return (len(keys) + list(PLAIN_TARGETS).index(name), name)
    suffix = name.split(".", 1)[1] if "." in name else name
    return (keys.index(suffix) if suffix in keys else len(keys) + len(PLAIN_TARGETS), name)


def merge(old: Iterable[Row], new: Iterable[Row]) -> list[Row]:
    """``old`` with each row of ``new`` replacing the one of the same name (or added), in
    TARGETS order, unknown names last by name."""
    by_name = {r["name"]: r for r in old}
    for r in new:
        by_name[r["name"]] = r
    return sorted(by_name.values(), key=lambda r: _order(r["name"]))


def load(path: Path) -> list[Row]:
    """The rows of a targets file; none where it does not exist yet."""
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds no list of rows")
    return rows


def write(path: Path, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2, allow_nan=False) + "\n")


def gpu_folder(device_name: str) -> str:
    """The results folder of a device: its name without memory size and type, spaces to
    underscores ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100", "NVIDIA H200" -> "NVIDIA_H200")."""
    words = [re.sub(r"-\d+GB$", "", w, flags=re.I) for w in device_name.split()]
    words = [w for w in words if not re.fullmatch(r"\d+[GM]B|HBM\w*|GDDR\w*", w, re.I)]
    return "_".join(words) or "unknown"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def table(rows: Sequence[Row], names: Iterable[str] | None = None) -> str:
    """A short text table of ``rows`` (only ``names`` when given)."""
    keep = set(names) if names is not None else None
    lines = [f"{'name':<38} {'value':>9} {'unit':<6} {'target':<8} {'met':<5} commit"]
    for r in rows:
        if keep is not None and r["name"] not in keep:
            continue
        flag = {True: "yes", False: "NO", None: "-"}[r["met"]]
        lines.append(
            f"{r['name']:<38} {_fmt(r['value']):>9} {r['unit']:<6} {r['target'] or '-':<8} "
            f"{flag:<5} {r['commit'] or '-'}" + (f"  ({r['note']})" if r.get("note") else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.targets", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="build rows from RAW_DIR and merge them into --targets")
    c.add_argument("raw", type=Path, help="folder of the tools' JSON outputs")
    c.add_argument("--targets", type=Path, required=True, help="targets.json to update")
    c.add_argument("--commit", default=None, help="the tree measured")
    c.add_argument("--prefix", default="md2", help="model prefix of the row names")
    c.add_argument("--suffix", default="", help="appended to every figure's name (e.g. _24gb)")
    s = sub.add_parser("show", help="print a targets file as a table")
    s.add_argument("targets", type=Path)
    g = sub.add_parser("gpu-folder", help="the results folder name of a device name")
    g.add_argument("device")
    args = ap.parse_args(argv)
    if args.cmd == "gpu-folder":
        print(gpu_folder(args.device))
        return 0
    if args.cmd == "show":
        print(table(load(args.targets)))
        return 0
    new = collect(args.raw, args.prefix, args.commit, args.suffix)
    rows = merge(load(args.targets), new)
    write(args.targets, rows)
    print(f"{len(new)} row(s) from {args.raw} merged into {args.targets}")
    print(table(rows, [r["name"] for r in new]))
    return 0 if new else 1


if __name__ == "__main__":
    sys.exit(main())
