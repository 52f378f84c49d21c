"""bench/quant_numerics.py on the CPU with the tiny model: the JSON's structure, INT8 closer
to the 16-bit model than INT4 (layers and logits), each measured error near its textbook
bound, and the target rows bench/targets.py builds from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import quant_numerics
from bench.targets import collect


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("numerics")
    path = folder / "quant_numerics.json"
    argv = ["--preset", "tiny", "--group-size", "32", "--prompts", "4", "--json", str(path)]
    assert quant_numerics.main(argv) == 0
    return folder, json.loads(path.read_text())


def test_int8_is_closer_than_int4(report: tuple[Path, dict]) -> None:
    _, out = report
    int8, int4 = out["formats"]["int8"], out["formats"]["int4"]
    assert out["prompts"] == 4
    assert [r["name"] for r in int8["layers"]] == [r["name"] for r in int4["layers"]]
    assert len(int8["layers"]) > 0
    assert int8["mean_rel_error"] < int4["mean_rel_error"]
    assert int8["logits_cosine"] > int4["logits_cosine"]
    for f in (int8, int4):
        assert 0 < f["logits_cosine"] <= 1 + 1e-6 and 0 <= f["top1_agreement"] <= 1
        for row in f["layers"]:  # rounding noise: within a factor of the textbook figure
            assert row["bound"] / 3 < row["rel_error"] < 3 * row["bound"]


def test_the_bound_is_the_textbook_one() -> None:
    w = torch.full((4, 64), 0.5)
    w[:, 0] = 1.0  # row max 1: the INT8 step 1/127
    rms = float(w.pow(2).mean().sqrt())
    assert quant_numerics.bound(w, 8, 0) == pytest.approx(1 / 127 / 12**0.5 / rms)
    assert quant_numerics.bound(w, 4, 32) > quant_numerics.bound(w, 8, 0)


def test_target_rows(report: tuple[Path, dict]) -> None:
    folder, out = report
    rows = {r["name"]: r for r in collect(folder, "md2", "abc")}
    assert rows["md2.int4.logits_cosine"]["value"] == round(
        out["formats"]["int4"]["logits_cosine"], 4
    )
    assert rows["md2.int8.logits_cosine"]["flags"] == "--weights int8"
    assert "md2.int4.top1_agreement" in rows
    assert (folder / "quant_numerics.png").exists() or quant_numerics.pyplot() is None
