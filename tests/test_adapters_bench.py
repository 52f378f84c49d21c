"""CPU smoke test of the adapter benchmark: a tiny run writes well-formed results, and
bench/targets.py turns them into the adapter rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench import lora_bench, targets


def test_lora_bench_writes_the_adapter_rows(tmp_path: Path) -> None:
    lora_bench.main(
        [
            "--preset", "tiny", "--dtype", "fp32", "--streams", "4", "--tokens", "12",
            "--adapters", "3", "--load-streams", "2", "--load-tokens", "200", "--loads", "2",
            "--warmup", "0.3", "--kv-gib", "0.05", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    raw = (tmp_path / "lora_bench.json").read_text()
    d = json.loads(raw, parse_constant=lambda token: (_ for _ in ()).throw(AssertionError(token)))
    assert set(d["period"]) == {"off", "none", "lora"}
    assert all(c["period_ms"] > 0 for c in d["period"].values())
    assert d["period_ratio"] > 0 and d["load_gap"]["gap_p50_before_ms"] > 0
    assert d["load_gap"]["gap_p99_resident_ms"] > 0 and d["load_gap"]["ratio"] > 0
    # The rows stand for rank-32 adapters: as run with the defaults.
    d["settings"].update(rank=32, adapters=8, streams=32)
    rows = {r["name"]: r for r in targets.lora_rows(d, "md2", "abc")}
    assert set(rows) == {"md2.lora8.period_ratio.s32", "md2.lora.load_gap_ratio"}
    assert rows["md2.lora8.period_ratio.s32"]["value"] == round(d["period_ratio"], 4)
    assert all(n.removeprefix("md2.") in targets.TARGETS for n in rows)
