"""The graphed step profile's table and plot (bench/step_profile.py) on a made-up replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import step_profile
from bench.kernel_timeline import Kernel, summarize


def test_the_report_and_plot_write_what_they_read(tmp_path: Path, capsys) -> None:
    kernels = [Kernel("_up_kernel", 0, 10), Kernel("_down_kernel", 12, 4)]
    batch = summarize([kernels]) | {"floor_us": 8.0}
    results = {"settings": {}, "batches": {"1": batch}}
    path = tmp_path / "step_profile.json"
    step_profile.plotting.write_rows(str(path), results, step_profile.plot)
    assert json.loads(path.read_text())["batches"]["1"]["floor_us"] == 8.0
    drawn = step_profile.plotting.pyplot() is not None
    assert (tmp_path / "step_profile.png").exists() == drawn
    step_profile.report(results)
    out = capsys.readouterr().out
    assert "batch 1: span 0.016 ms" in out and "floor 0.008 ms" in out
    assert "experts fc1 -> experts fc2" in out


def test_the_tower_timeline_prints_and_plots_the_same_summary(tmp_path: Path, capsys) -> None:
    from bench import tower_timeline

    kernels = [Kernel("nvjet_sm90_tst_128x232_bias_TNT", 0, 50), Kernel("_add_layernorm", 53, 20)]
    out = summarize([kernels]) | {"device": "X", "crops": 9, "replay_ms": 0.08}
    tower_timeline.print_table(out)
    text = capsys.readouterr().out
    assert "cuBLAS products" in text and "cuBLAS products -> norms" in text
    drawn = tower_timeline.plot(out, tmp_path / "t.png")
    assert drawn == (step_profile.plotting.pyplot() is not None) == (tmp_path / "t.png").exists()


def test_a_set_changes_a_constant_that_exists_and_refuses_others() -> None:
    from vlm_server.models.moondream3 import text

    step_profile.set_constant("vlm_server.models.moondream3.text:FUSED_COMBINE=False")
    try:
        assert text.FUSED_COMBINE is False
    finally:
        text.FUSED_COMBINE = True
    for bad in ("vlm_server.models.moondream3.text:NOPE=1", "text=1", "a:b"):
        with pytest.raises(SystemExit):
            step_profile.set_constant(bad)
