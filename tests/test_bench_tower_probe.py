"""CPU smoke test of the tower step of bench/targets.sh: the probe takes the script's flags,
refuses a machine without CUDA, and what it writes becomes the tower rows of targets.json
(the GPU figures themselves come from bench/targets.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import plotting, targets, tower_probe


def test_the_targets_flags_parse_and_a_cpu_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without CUDA")
    out = tmp_path / "tower.json"
    flags = ["--tower-only", "--tower-crops", "9", "--json", str(out)]
    assert tower_probe.main(flags) == 1
    assert "needs a CUDA device" in capsys.readouterr().out
    assert not out.exists()


def test_the_written_tower_becomes_the_targets_rows(tmp_path: Path) -> None:
    rows: list[dict] = [
        {"crops": c, "mode": mode, "ms": ms * c / 9, "crops_per_s": 9 / ms * 1e3}
        for c in (1, 9)
        for mode, ms in (("bf16", 12.4), ("fp8", 9.9), ("fp8 scales in GEMM", 10.4))
    ]
    rows.append({"crops": 1, "fp8_vs_bf16_rel_err": 0.011, "fp8_vs_bf16_min_cos": 0.9999})
    path = tmp_path / "tower.json"
    assert tower_probe._dump({"device": "test", "crops": 9, "tower": rows}, str(path)) == 0
    by = {r["name"]: r for r in targets.tower_rows(json.loads(path.read_text()), "md2", "c")}
    assert set(by) == {f"md2.tower.crops{c}.{m}_ms" for c in (1, 9) for m in ("bf16", "fp8")}
    assert by["md2.tower.crops9.bf16_ms"]["value"] == pytest.approx(12.4)
    assert by["md2.tower.crops9.fp8_ms"]["flags"] == "--vision-fp8 true"
    assert path.with_suffix(".png").exists() == (plotting.pyplot() is not None)
