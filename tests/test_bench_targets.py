"""bench.targets: rows from the benchmarks' outputs, merged by name into targets.json, with
``met`` read against ``<=`` and ``>=`` bounds; and the figures of record it seeds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import targets

ROOT = Path(__file__).resolve().parents[1]
SERVE = [
    "--model",
    "/ckpt/vlm-bench",
    "--device",
    "cuda",
    "--dtype",
    "bf16",
    "--vision-fp8",
    "true",
]
KEYS = {"name", "value", "unit", "target", "met", "commit", "flags"}


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def _load_gen() -> dict[str, Any]:
    def row(scenario: str, conc: int, door: str = "grpc", ok: int = 10, **figures: float):
        return {"scenario": scenario, "concurrency": conc, "door": door, "ok": ok, **figures}

    return {
        "server_args": SERVE,
        "server_startup_s": 41.5,
        "rows": [
            row("query3/800x600/unique", 1, e2e_p50_ms=24.0, req_per_s=34.0),
            row("query3/800x600/unique", 64, e2e_p50_ms=990.0, req_per_s=58.5),
            row("query3/800x600/unique", 64, door="http", req_per_s=99.0),  # not the gRPC row
            row("query3/800x600/repeated", 64, req_per_s=758.9),
            row(
                "caption128/800x600/unique",
                32,
                tokens_per_s=4100.0,
                ttft_p50_ms=480.0,
                itl_p99_ms=7.5,
            ),
            row("query3/4000x3000/unique", 1, e2e_p50_ms=52.9),  # no target row of its own
            row("query3/800x600/repeated", 1, ok=0, e2e_p50_ms=None),  # nothing done
        ],
    }


def test_met_reads_both_bounds() -> None:
    assert targets.met(29.0, "<= 30") is True
    assert targets.met(30.0, "<= 30") is True
    assert targets.met(30.1, "<= 30") is False
    assert targets.met(64.0, ">= 60") is True
    assert targets.met(60.0, ">= 60") is True
    assert targets.met(59.9, ">= 60") is False
    assert targets.met(1.7, "<=1.91") is True
    assert targets.met(None, "<= 30") is None
    assert targets.met(12.0, None) is None
    assert targets.met(float("nan"), "<= 30") is None
    with pytest.raises(ValueError):
        targets.met(1.0, "< 2")


def test_load_rows_name_unit_bound_and_flags() -> None:
    rows = _by_name(targets.load_rows(_load_gen(), "md2", "abc1234"))
    assert set(rows) == {
        "md2.query3.unique.c1.p50_ms",
        "md2.query3.unique.c64.req_s",
        "md2.query3.repeated.c64.req_s",
        "md2.caption128.unique.c32.tok_s",
        "md2.caption128.unique.c32.ttft_p50_ms",
        "md2.caption128.unique.c32.gap_p99_ms",
        "md2.startup_s",
    }
    for r in rows.values():
        assert set(r) == KEYS and r["commit"] == "abc1234"
        assert r["flags"] == "--device cuda --dtype bf16 --vision-fp8 true"  # no --model
    c1 = rows["md2.query3.unique.c1.p50_ms"]
    assert (c1["value"], c1["unit"], c1["target"], c1["met"]) == (24.0, "ms", "<= 25", True)
    c64 = rows["md2.query3.unique.c64.req_s"]
    assert (c64["value"], c64["unit"], c64["target"], c64["met"]) == (58.5, "req/s", ">= 65", False)
    assert rows["md2.query3.repeated.c64.req_s"]["met"] is True
    caption = rows["md2.caption128.unique.c32.tok_s"]
    assert (caption["value"], caption["target"], caption["met"]) == (4100.0, ">= 4000", True)
    ttft = rows["md2.caption128.unique.c32.ttft_p50_ms"]
    assert (ttft["value"], ttft["target"], ttft["met"]) == (480.0, "<= 150", False)
    gap = rows["md2.caption128.unique.c32.gap_p99_ms"]
    assert (gap["value"], gap["target"], gap["met"]) == (7.5, "<= 10", True)
    startup = rows["md2.startup_s"]
    assert (startup["value"], startup["unit"], startup["met"]) == (41.5, "s", False)


def test_a_family_bound_overrides_the_default_and_a_suffix_names_other_conditions(
    tmp_path: Path,
) -> None:
    md3 = targets.make_row("md3", "query3.unique.c1.p50_ms", 38.0, "abc", "")
    assert (md3["target"], md3["met"]) == ("<= 30", False)
    assert targets.make_row("md2", "query3.unique.c1.p50_ms", 24.0, "abc", "")["met"] is True
    assert targets.make_row("md3", "decode.period_ms.s1", 1.1, "abc", "")["target"] == "<= 1.20"
    assert targets.make_row("md3", "caption128.unique.c32.tok_s", 1.0, "abc", "")["met"] is None
    # A variant of the family (md3 with bf16 experts) takes its own row's bound.
    bf16 = targets.make_row("md3.bf16", "decode.period_ms.s1", 1.5, "abc", "")
    assert (bf16["name"], bf16["target"], bf16["met"]) == (
        "md3.bf16.decode.period_ms.s1",
        "<= 1.60",
        True,
    )
    (tmp_path / "load_gen.json").write_text(json.dumps(_load_gen()))
    rows = _by_name(targets.collect(tmp_path, "md3", "abc", "_24gb"))
    assert set(rows) == {"md3.query3.unique.c64.req_s_24gb"}
    assert rows["md3.query3.unique.c64.req_s_24gb"]["value"] == 58.5


def test_step_image_tower_and_arrival_rows() -> None:
    step = {
        "rows": [
            {"streams": 1, "depth": 1, "period_ms": 1.95},
            {"streams": 1, "depth": 2, "period_ms": 1.25, "floor_ms": 0.8},
            {"streams": 32, "depth": 2, "period_ms": 3.4},
        ]
    }
    rows = _by_name(targets.step_rows(step, "md2", "c"))
    assert rows["md2.decode.period_ms.s1"]["value"] == 1.25  # pipelined, not blocking
    assert rows["md2.decode.floor_ms.s1"]["value"] == 0.8
    assert "md2.decode.floor_ms.s32" not in rows
    assert rows["md2.decode.period_ms.s1"]["met"] is True
    assert rows["md2.decode.period_ms.s32"]["met"] is False  # bound 2.90
    assert rows["md2.decode.period_ms.s1"]["flags"] == ""

    def cell(size: str, cpu: float, sm: float | None, **more: Any) -> dict[str, Any]:
        base = {"size": size, "format": "jpeg", "threads": 1, "resize": "vips"}
        return base | {"cpu_ms": cpu, "sm_ms": sm} | more

    image = {
        "gpu_decode_min_pixels": 1,
        "gpu_decoder": "nvimgcodec",
        "split": False,
        "rows": [
            cell("800x600", 1.65, 0.36),
            cell("800x600", 7.7, None, threads=8),
            cell("4000x3000", 5.7, 2.45),
        ],
    }
    rows = _by_name(targets.image_rows(image, "md2", "c"))
    assert {n: (r["value"], r["target"], r["met"]) for n, r in rows.items()} == {
        "md2.image.800x600.host_cpu_ms": (1.65, "<= 3", True),
        "md2.image.800x600.gpu_sm_ms": (0.36, "<= 1", True),
        "md2.image.4000x3000.host_cpu_ms": (5.7, "<= 45", True),
        "md2.image.4000x3000.gpu_sm_ms": (2.45, "<= 3", True),
    }
    flags = "--image-gpu-decode-min-pixels 1 --image-gpu-decoder nvimgcodec"
    assert {r["flags"] for r in rows.values()} == {flags}
    host = image | {"gpu_decode_min_pixels": 0, "rows": [cell("800x600", 4.9, None)]}
    assert [(r["name"], r["flags"]) for r in targets.image_rows(host, "md2", "c")] == [
        ("md2.image.800x600.host_cpu_ms", "")
    ]
    assert targets.image_rows(image | {"split": True}, "md2", "c") == []

    tower = {
        "tower": [
            {"crops": 9, "mode": "bf16", "ms": 12.56},
            {"crops": 9, "mode": "fp8", "ms": 10.42},
            {"crops": 9, "mode": "fp8 scales in GEMM", "ms": 10.9},
            {"crops": 9, "fp8_vs_bf16_rel_err": 0.01},
        ]
    }
    rows = _by_name(targets.tower_rows(tower, "md2", "c"))
    assert set(rows) == {"md2.tower.crops9.bf16_ms", "md2.tower.crops9.fp8_ms"}
    bf16 = rows["md2.tower.crops9.bf16_ms"]
    assert (bf16["met"], bf16["flags"]) == (False, "")
    fp8 = rows["md2.tower.crops9.fp8_ms"]
    assert (fp8["met"], fp8["flags"]) == (True, "--vision-fp8 true")

    arrivals = {
        "complete": True,
        "server_args": SERVE,
        "settings": {"streams": 16, "rate": 20.0},
        "verdict": {"server_ratio_b_p99_over_a_p50": 1.95},
    }
    [row] = targets.arrival_rows(arrivals, "md2", "c")
    assert (row["name"], row["unit"], row["target"], row["met"]) == (
        "md2.arrivals.s16.r20.step_gap_ratio",
        "x",
        "<= 2",
        True,
    )
    assert targets.arrival_rows(arrivals | {"complete": False}, "md2", "c") == []
    assert "note" not in row
    # An idle phase whose own tail jittered: the row stands as measured, and says so.
    quiet = arrivals | {"verdict": arrivals["verdict"] | {"server_idle_spread": 1.29}}
    assert "note" not in targets.arrival_rows(quiet, "md2", "c")[0]
    jittered = arrivals | {
        "verdict": {"server_ratio_b_p99_over_a_p50": 2.61, "server_idle_spread": 1.9}
    }
    [noted] = targets.arrival_rows(jittered, "md2", "c")
    assert noted["value"] == 2.61 and noted["met"] is False
    assert "1.90" in noted["note"] and "jittered" in noted["note"]
    assert noted["note"] in targets.table([noted]) and "(" not in targets.table([row])
    # Files written before the verdict carried it: phase A's own server figures say it.
    older = arrivals | {"phases": {"A": {"server_itl_p50_ms": 2.27, "server_itl_p99_ms": 4.32}}}
    assert "1.90" in targets.arrival_rows(older, "md2", "c")[0]["note"]


def test_merge_replaces_by_name_and_keeps_the_rest(tmp_path: Path) -> None:
    old = [
        targets.make_row("md2", "tower.crops9.fp8_ms", 10.4, "old", "--vision-fp8 true"),
        targets.make_row("md2", "query3.unique.c1.p50_ms", 30.1, "old", "--vision-fp8 true"),
        targets.make_row("md2", "something.else", 1.0, "old", ""),
    ]
    new = [targets.make_row("md2", "query3.unique.c1.p50_ms", 24.0, "new", "")]
    merged = targets.merge(old, new)
    assert [r["name"] for r in merged] == [
        "md2.query3.unique.c1.p50_ms",  # in TARGETS order, unknown names last
        "md2.tower.crops9.fp8_ms",
        "md2.something.else",
    ]
    by = _by_name(merged)
    assert (
        by["md2.query3.unique.c1.p50_ms"]["value"],
        by["md2.query3.unique.c1.p50_ms"]["met"],
    ) == (
        24.0,
        True,
    )
    assert by["md2.tower.crops9.fp8_ms"]["commit"] == "old"

    # The command: a partial run's folder updates only its rows, and the file is strict JSON.
    path = tmp_path / "NVIDIA_H100" / "targets.json"
    targets.write(path, old)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "load_gen.json").write_text(json.dumps(_load_gen()))
    assert targets.main(["collect", str(raw), "--targets", str(path), "--commit", "abc"]) == 0
    rows = _by_name(json.loads(path.read_text()))
    assert rows["md2.query3.unique.c1.p50_ms"]["commit"] == "abc"
    assert rows["md2.tower.crops9.fp8_ms"]["commit"] == "old"
    assert rows["md2.something.else"]["value"] == 1.0
    assert len(rows) == 9
    empty = tmp_path / "empty"
    empty.mkdir()
    assert targets.main(["collect", str(empty), "--targets", str(path)]) == 1  # no rows
    assert len(json.loads(path.read_text())) == 9


def test_collect_reads_what_the_tools_write(tmp_path: Path) -> None:
    """Every tool's output file name, as the tools write it, gives rows."""
    (tmp_path / "step_bench.json").write_text(
        json.dumps({"rows": [{"streams": 1, "depth": 2, "period_ms": 1.7}]})
    )
    (tmp_path / "tower.json").write_text(
        json.dumps({"tower": [{"crops": 9, "mode": "fp8", "ms": 10.4}]})
    )
    (tmp_path / "image_bench.json").write_text("{not json")  # unreadable: no rows, no error
    names = [r["name"] for r in targets.collect(tmp_path, "tiny", "c")]
    assert names == ["tiny.decode.period_ms.s1", "tiny.tower.crops9.fp8_ms"]


@pytest.mark.parametrize(
    ("device", "folder"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA_H100"),
        ("NVIDIA H200", "NVIDIA_H200"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA_A100-SXM4"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA_GeForce_RTX_4090"),
    ],
)
def test_gpu_folder_is_named_like_the_results_folders(device: str, folder: str) -> None:
    assert targets.gpu_folder(device) == folder


def test_the_seeded_figures_of_record_are_well_formed() -> None:
    path = ROOT / "bench" / "results" / "NVIDIA_H100" / "targets.json"
    rows = json.loads(path.read_text())
    md2 = [r["name"] for r in rows if r["name"].startswith("md2.")]
    assert md2 == [f"md2.{n}" for n in targets.TARGETS if n not in targets.FAMILY_ONLY]
    assert [r["name"] for r in rows] == [r["name"] for r in targets.merge([], rows)]
    for r in rows:
        assert set(r) - {"note"} == KEYS, r  # a note only where the measurement says why
        assert "note" not in r or r["name"].startswith(("md2.arrivals", "md2.startup")), r
        prefix, name = r["name"].split(".", 1)
        unit, target = targets.TARGETS[name]
        target = targets.FAMILY_BOUNDS.get(prefix, {}).get(name, target)
        assert (r["unit"], r["target"]) == (unit, target), r
        assert r["met"] == targets.met(r["value"], r["target"]), r
        assert r["value"] is None or r["commit"], r
        assert "/" not in r["flags"], r  # no machine's paths


def test_targets_sh_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "targets.sh")], check=True)


def test_gateway_rows_carry_no_model_prefix_and_follow_the_models_rows() -> None:
    from bench import gateway_bench

    data = {
        "cpus": 2,
        "traffic": "repeated",
        "rows": [
            {"stand_ins": 16, "variant": "direct", "req_per_s": 900.0},
            {"stand_ins": 16, "variant": "gateway x2", "workers": 2, "req_per_s": 1.0},
            {"stand_ins": 16, "variant": "gateway x1", "workers": 1, "req_per_s": 500.0},
        ],
    }
    data["rows"][1]["default_workers"] = False
    data["rows"][2]["default_workers"] = True
    (row,) = gateway_bench.rows_of(data, "abc1234")
    assert row["name"] == "gateway.repeated.req_s_16stand_ins"
    assert (row["value"], row["unit"], row["target"], row["met"]) == (
        500.0,
        "req/s",
        ">= 12000",
        False,
    )
    assert row["flags"] == "--gateway-workers 1"
    assert row["note"] == "2 CPUs shared with the load and the stand-ins"
    model = targets.make_row("md2", "decode.period_ms.s1", 1.2, "abc1234", "")
    assert [r["name"] for r in targets.merge([row], [model])] == [model["name"], row["name"]]
