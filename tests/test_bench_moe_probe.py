"""bench/moe_probe.py's table on the CPU: the winners it prints paste into `moe_triton.TILES`."""

from __future__ import annotations

import pytest

from bench import moe_probe
from vlm_server.models.moondream3 import moe_triton
from vlm_server.models.moondream3.moe_triton import ExpertTiles, Tile


def _row(n: int, name: str, tiles: ExpertTiles, us: float, ok: bool = True) -> dict:
    row = {"weights": "fp8", "tokens": n, "floor_us": 5.0, "variant": name, "tiles": str(tiles)}
    row.update({"bm": tiles.bm, "ok": ok, "layer_us": us, "grouped_us": us / 2})
    row.update({f"up_{f}": getattr(tiles.up, f) for f in vars(tiles.up)})
    row.update({f"down_{f}": getattr(tiles.down, f) for f in vars(tiles.down)})
    return row


def test_the_printed_winners_are_a_tiles_table(capsys: pytest.CaptureFixture[str]) -> None:
    fast = moe_probe.DECODE[2]
    wrong = moe_probe.DECODE[3]  # fastest, but fails the check: never a winner
    big = moe_probe.PREFILL[1]
    rows = [
        _row(1, "legacy", moe_probe.legacy_tiles(8, 64), 90.0),
        _row(1, "tiles", fast, 30.0),
        _row(1, "tiles", wrong, 10.0, ok=False),
        _row(730, "legacy", moe_probe.legacy_tiles(5840, 64), 900.0),
        _row(730, "tiles", big, 300.0),
    ]
    moe_probe.summary(rows)
    out = capsys.readouterr().out
    assert "3.00" in out  # legacy / best
    snippet = out[out.index("TILES = (") :]
    space = {"Tile": Tile, "ExpertTiles": ExpertTiles}
    exec(snippet, space)  # the probe's own output
    table = space["TILES"]
    assert moe_triton.pick_tiles(1, table) == fast
    assert moe_triton.pick_tiles(2, table) == big and moe_triton.pick_tiles(5000, table) == big


def test_the_fp8_probe_picks_the_fastest_tile_and_redraws_saved_rows(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from pathlib import Path

    from bench import moe_fp8_probe, plotting

    rows = [
        {"tokens": 730, "variant": "bf16 act", "tiles": "t0", "us": 370.0, "rel_err": 0.0},
        {"tokens": 730, "variant": "quant x", "tiles": "-", "us": 5.0, "rel_err": 0.0},
        {"tokens": 730, "variant": "fp8 act", "tiles": "a", "us": 300.0, "rel_err": 0.04},
        {"tokens": 730, "variant": "fp8 act", "tiles": "b", "us": 260.0, "rel_err": 0.04},
    ]
    assert moe_fp8_probe.best(rows, 730)["tiles"] == "b"  # type: ignore[index]
    assert moe_fp8_probe.best(rows, 5840) is None
    moe_fp8_probe.summary(rows)
    assert "1.42" in capsys.readouterr().out  # 370 / 260
    path = Path(str(tmp_path)) / "moe_fp8_probe.json"
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    if plotting.pyplot() is not None:
        assert plotting.replot(str(path), moe_fp8_probe.plot) == 0
        assert Path(plotting.png_beside(str(path))).exists()
