"""``vlm compare`` (compare_command.py, compare_scores.py): the greedy matching and scores on
hand-made answers, and two runs on the tiny model over a folder: a model against itself agrees
on everything; against its INT8 quantization the report has every task, as text and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.batch_files import engine_flags, write_pictures
from vlm_server.cli import main as cli_main
from vlm_server.compare_scores import box_iou, matched_distances, matched_iou, score_task
from vlm_server.models.quantized import quantize_checkpoint

SHORT = ["--max-tokens", "4"]


def test_boxes_are_matched_greedily() -> None:
    a = (0.0, 0.0, 0.5, 0.5)
    b = (0.25, 0.0, 0.75, 0.5)
    assert box_iou(a, a) == 1.0
    assert box_iou(a, b) == pytest.approx(1 / 3)
    assert box_iou(a, (0.6, 0.6, 0.9, 0.9)) == 0.0
    assert matched_iou([], []) == 1.0
    assert matched_iou([a, b], [b, a]) == 1.0  # the order does not matter
    assert matched_iou([a], [a, b]) == 0.5  # the box left alone counts 0
    assert matched_iou([a], []) == 0.0


def test_points_are_matched_greedily() -> None:
    found, left = matched_distances([(0.1, 0.1), (0.9, 0.9)], [(0.9, 0.8), (0.1, 0.2)])
    assert sorted(found) == pytest.approx([0.1, 0.1]) and left == 0
    found, left = matched_distances([(0.0, 0.0)], [(0.3, 0.4), (0.0, 0.1)])
    assert found == pytest.approx([0.1]) and left == 1


def test_scores_of_a_task() -> None:
    box = {"x_min": 0.0, "y_min": 0.0, "x_max": 0.5, "y_max": 0.5}
    other = {"x_min": 0.25, "y_min": 0.0, "x_max": 0.75, "y_max": 0.5}
    a = {"p1": {"objects": [box]}, "p2": {"objects": [box]}}
    b = {"p1": {"objects": [box]}, "p2": {"objects": [other]}}
    s = score_task("detect", a, b, total=3)
    assert (s.pictures, s.identical, s.failed) == (2, 0.5, 1)
    assert s.mean_iou == pytest.approx((1 + 1 / 3) / 2)
    pa = {"p": {"points": [{"x": 0.0, "y": 0.0}]}}
    pb = {"p": {"points": [{"x": 0.3, "y": 0.4}]}}
    s = score_task("point", pa, pb, total=1)
    assert s.mean_point_distance == pytest.approx(0.5) and s.identical == 0.0
    s = score_task("caption", {"p": {"caption": "x"}}, {"p": {"caption": "x"}}, total=1)
    assert s.identical == 1.0 and s.mean_iou is None


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_pictures(folder, 3)
    return folder


def _flags(model: Path) -> list[str]:
    return [f for f in engine_flags(model) if f not in ("--model", str(model))]


def test_a_model_against_itself_agrees_on_everything(
    photos: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", str(photos), "--model", str(tiny_dir), "--model", str(tiny_dir)]
    assert cli_main([*argv, *SHORT, "--json", *_flags(tiny_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["task"] for t in report["tasks"]] == ["caption", "query", "detect", "point"]
    for task in report["tasks"]:
        assert task["pictures"] == 3 and task["failed"] == 0
        assert task["identical"] == 1.0
    detect, point = report["tasks"][2], report["tasks"][3]
    assert detect["mean_iou"] == 1.0
    assert point["unmatched_points"] == 0
    assert point["mean_point_distance"] in (None, 0.0)


def test_a_model_against_its_int8_weights(
    photos: Path, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quantized = tmp_path / "int8"
    quantize_checkpoint(tiny_dir, quantized, "int8")
    argv = ["compare", str(photos), "--model", str(tiny_dir), "--model", str(quantized)]
    assert cli_main([*argv, *SHORT, "--tasks", "caption,detect", *_flags(tiny_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"A: {tiny_dir}", f"B: {quantized}"]
    assert out[2].startswith("caption  3 pictures, identical ")
    assert out[3].startswith("detect   3 pictures, identical ") and "mean box IoU" in out[3]
    share = float(out[2].split("identical ")[1].split("%")[0])
    assert 0.0 <= share <= 100.0 and not math.isnan(share)


def test_bad_input_names_the_flag(
    photos: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", str(photos), "--model", str(tiny_dir), "--model", str(tiny_dir)]
    assert cli_main([*argv, "--tasks", "caption,dance"]) == 2
    assert "--tasks: dance not of caption" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["compare", str(photos), "--model", str(tiny_dir)])
    assert "--model: give two models" in capsys.readouterr().err
