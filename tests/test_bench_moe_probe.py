"""bench/moe_probe.py's table on the CPU: the winners it prints paste into `moe_triton.TILES`."""

from __future__ import annotations

import pytest
import torch

from bench import moe_probe
from vlm_server.models.moondream3 import moe_triton
from vlm_server.models.moondream3.moe_triton import ExpertTiles, Tile, legacy_tiles


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
        _row(1, "legacy", legacy_tiles(8, 64), 90.0),
        _row(1, "tiles", fast, 30.0),
        _row(1, "tiles", wrong, 10.0, ok=False),
        _row(730, "legacy", legacy_tiles(5840, 64), 900.0),
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


def test_the_routing_probe_names_the_modules_setting_and_redraws_both_formats(
    tmp_path: object,
) -> None:
    import json
    from pathlib import Path

    from bench import moe_routing_probe, plotting
    from vlm_server.models.moondream3 import moe_routing

    name = moe_routing_probe.default_setting()
    assert name == (
        f"c{moe_routing.CHUNK_PAIRS}w{moe_routing.ROUTE_WARPS}"
        f"s{moe_routing.SINGLE_MAX_TOKENS}p{moe_routing.MAX_PROGRAMS}"
    )
    row = {"tokens": 730, "torch_us": 1100.0, "us": {name: 12.0, "x": 11.0}, "best": "x"}
    have_plot = plotting.pyplot() is not None
    for i, saved in enumerate(([row], {"device": "test", "rows": [{**row, "default": name}]})):
        path = Path(str(tmp_path)) / f"routing{i}.json"
        path.write_text(json.dumps(saved))
        assert plotting.replot(str(path), moe_routing_probe.plot) == (0 if have_plot else 1)
        assert Path(plotting.png_beside(str(path))).exists() == have_plot


def test_the_grouped_mm_probe_ends_each_expert_group_where_the_grouping_does(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from pathlib import Path

    from bench import grouped_mm_probe, plotting
    from vlm_server.models.moondream3 import moe_routing, moe_triton

    n_experts, bm = 8, 4
    # 13 tokens over experts 0-5: 6 and 7 (the last) get no pairs, so empty groups
    ids = torch.tensor([[t % 6, (t * 5 + 1) % 6] for t in range(13)])
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 6, ids[:, 1])
    pairs, block_expert, used = moe_triton.align(ids, n_experts, bm)
    ends = grouped_mm_probe.group_ends(moe_routing.Routing(pairs, block_expert, used, bm), 8)
    counts = torch.bincount(ids.reshape(-1), minlength=n_experts)
    want = ((counts + bm - 1) // bm * bm).cumsum(0)
    assert ends.tolist() == want.tolist()
    assert ends[-1].item() == used.item()  # the spare trailing blocks are not the last group's
    for e in range(n_experts):  # every row of a group holds a pair of that expert, or padding
        start = 0 if e == 0 else ends[e - 1].item()
        for p in pairs[start : ends[e]].tolist():
            assert p == ids.numel() or ids.reshape(-1)[p].item() == e

    rows = [
        {"tokens": 730, "variant": "triton layer", "us": 254.0},
        {"tokens": 730, "variant": "grouped bm16", "us": 294.5, "gather": 9.5, "gmm1": 126.7},
    ]
    grouped_mm_probe.summary(rows)
    assert "294.5" in capsys.readouterr().out
    path = Path(str(tmp_path)) / "grouped_mm_probe.json"
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    if plotting.pyplot() is not None:
        assert plotting.replot(str(path), grouped_mm_probe.plot) == 0
        assert Path(plotting.png_beside(str(path))).exists()
