"""bench.scaleout's offline parts on the CPU: the affinity order, the hit rate and the target
rows it writes from measured runs (the runs themselves need several GPUs)."""

from __future__ import annotations

import math

import pytest

from bench import scaleout
from bench.load_gen import Record
from vlm_server.client import types as t


def test_affinity_order_interleaves_each_block_of_pictures() -> None:
    pictures = [bytes([i]) for i in range(5)]
    order = scaleout.affinity_order(pictures, questions=3, block=2)
    a, b, c, d, e = pictures
    assert order == [a, b, a, b, a, b, c, d, c, d, c, d, e, e, e]


def _record(cached: int, ok: bool = True) -> Record:
    metrics = t.Metrics(input_tokens=10, output_tokens=3, cached_tokens=cached)
    return Record(ok=ok, server=metrics)


def test_hit_rate_counts_repeats_served_from_a_cached_prefix() -> None:
    # 2 pictures, 4 questions each: 6 repeats, of which 4 found the prefix (one failed).
    records = [_record(0), _record(0)] + [_record(730)] * 4 + [_record(0), _record(730, ok=False)]
    assert scaleout.hit_rate(records, pictures=2) == pytest.approx(4 / 6)
    assert math.isnan(scaleout.hit_rate(records[:2], pictures=2))  # no repeats: no rate


def _run(replicas: int, unique: float, affinity: float, hits: float, p50: float) -> dict:
    return {
        "replicas": replicas,
        "ingress": "gateway",
        "scenarios": {
            "unique.c128": {"req_per_s": unique},
            "affinity.c128": {"req_per_s": affinity, "hit_rate": hits},
            "unique.c1": {"e2e_p50_ms": p50},
        },
    }


def test_rows_from_one_and_two_replicas_and_the_alone_run() -> None:
    data = {
        "server_args": ["--model", "m", "--dtype", "bf16"],
        "runs": {
            "r1": _run(1, 60.0, 500.0, 0.5, 31.0),
            "r2": _run(2, 117.0, 990.0, 0.95, 33.0),
            "alone": {"replicas": 1, "scenarios": {"unique.c1": {"e2e_p50_ms": 30.0}}},
        },
    }
    got = {r["name"]: r for r in scaleout.rows(data, "md2", "abc1234")}
    assert got["md2.scaleout.query3.unique.c128.speedup_2gpu"]["value"] == pytest.approx(1.95)
    assert got["md2.scaleout.query3.unique.c128.speedup_2gpu"]["met"] is True
    assert got["md2.scaleout.query3.affinity.speedup_2gpu"]["value"] == pytest.approx(1.98)
    assert got["md2.scaleout.query3.affinity.hit_rate"]["value"] == pytest.approx(0.95)
    ratio = got["md2.scaleout.query3.unique.c1.p50_ratio"]
    assert ratio["value"] == pytest.approx(1.1) and ratio["met"] is True  # the most replicas: r2
    assert all(r["commit"] == "abc1234" for r in got.values())


def test_rows_wait_for_the_runs_they_compare() -> None:
    """One replica alone gives no speedup, and no ratio without the alone run."""
    assert scaleout.rows({"runs": {"r1": _run(1, 60.0, 500.0, 0.5, 31.0)}}, "md2", None) == []


def _run_at(replicas: int, clients: int, unique: float, hits: float) -> dict:
    scenarios = {
        f"unique.c{clients}": {"req_per_s": unique},
        f"affinity.c{clients}": {"req_per_s": unique * 8, "hit_rate": hits},
        "unique.c1": {"e2e_p50_ms": 32.0},
    }
    return {"replicas": replicas, "clients": clients, "scenarios": scenarios}


def test_four_and_eight_replicas_plan_more_clients_and_give_their_rows() -> None:
    """The CPU dry run of ``--replicas 1 2 4 8``: 64 clients a replica past two (128 at
    least), requests grown alike; measured runs of those shapes give the rows past 2 GPUs."""
    args, server = scaleout.parse(["--replicas", "1", "2", "4", "8", "--", "--model", "m"])
    assert server == ["--model", "m"]
    runs = {r.name: r for r in scaleout.plan(args)}
    assert list(runs) == ["r1", "r2", "r4", "r8", "alone"]
    assert [runs[n].clients for n in ("r1", "r2", "r4", "r8")] == [128, 128, 256, 512]
    assert [runs[n].requests for n in ("r1", "r4", "r8")] == [2048, 4096, 8192]
    assert runs["r8"].command == ["cluster", "--replicas", "8"]
    data = {
        "server_args": server,
        "runs": {
            "r1": _run_at(1, 128, 60.0, 0.5),
            "r2": _run_at(2, 128, 118.0, 0.97),
            "r4": _run_at(4, 256, 234.0, 0.95),
            "r8": _run_at(8, 512, 438.0, 0.93),
        },
    }
    got = {r["name"]: r for r in scaleout.rows(data, "md2", "abc1234")}
    four = got["md2.scaleout.query3.unique.c256.speedup_4gpu"]
    assert four["value"] == pytest.approx(3.9) and four["met"] is True
    eight = got["md2.scaleout.query3.unique.c512.speedup_8gpu"]
    assert eight["value"] == pytest.approx(7.3) and eight["met"] is False  # under 7.4
    hits = got["md2.scaleout.query3.affinity.hit_rate_8gpu"]
    assert hits["value"] == pytest.approx(0.93) and hits["met"] is True
    assert got["md2.scaleout.query3.affinity.hit_rate"]["value"] == pytest.approx(0.97)
    assert "md2.scaleout.query3.unique.c1.p50_ratio" not in got  # no alone run
    with pytest.raises(SystemExit):
        scaleout.parse(["--replicas", "0"])
