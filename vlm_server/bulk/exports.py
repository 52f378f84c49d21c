"""Dataset files written from a finished folder batch's results: COCO (detect: boxes; point:
keypoints) and YOLO (detect). The results file stays the record; these are rewritten from it
at the end of every run that finishes.

A picture is exported when every one of its lines succeeded (with several objects, a failed
object would otherwise read as "none there"); a picture that succeeded with nothing found is
exported with no annotations (COCO) or an empty label file (YOLO), as a negative. Class ids
follow the order of the objects asked for: YOLO counts from 0, COCO categories from 1.
Coordinates are clipped to the picture first; a box left with no width or height is dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from image_pipeline import ImageError, ImageLimits
from image_pipeline.decode import read_header
from vlm_server.bulk.folder import PictureLine
from vlm_server.bulk.lines import succeeded

Answers = dict[str, list[tuple[str, dict[str, Any]]]]  # picture -> [(object, answer body)]


def export_path(out: Path, fmt: str) -> Path:
    """Where ``fmt`` goes for results file ``out``: beside it, named after it without its
    ``.jsonl``: ``boxes.jsonl`` -> ``boxes.coco.json`` (a file), ``boxes.yolo`` (a folder)."""
    base = out.name.removesuffix(".jsonl")
    return out.with_name(f"{base}.coco.json" if fmt == "coco" else f"{base}.yolo")


def yolo_label(picture: str) -> str:
    """A picture's label file under the YOLO folder's ``labels/``: its path, ``.txt``."""
    return Path(picture).with_suffix(".txt").as_posix()


def yolo_clash(pictures: Sequence[str]) -> tuple[str, str] | None:
    """Two pictures whose label files would be the same (``a.jpg`` and ``a.png``)."""
    seen: dict[str, str] = {}
    for picture in pictures:
        label = yolo_label(picture)
        if label in seen:
            return seen[label], picture
        seen[label] = picture
    return None


def answers(lines: Sequence[PictureLine], results: Mapping[str, dict[str, Any]]) -> Answers:
    """The answers of every picture all of whose lines succeeded, in the lines' order."""
    found: Answers = {}
    failed: set[str] = set()
    for line in lines:
        result = results.get(line.custom_id)
        if result is None or not succeeded(result):
            failed.add(line.picture)
            continue
        found.setdefault(line.picture, []).append((line.object or "", result["response"]["body"]))
    return {p: a for p, a in found.items() if p not in failed}


def _clip(value: float) -> float:
    return min(1.0, max(0.0, float(value)))


def _box(region: Mapping[str, float]) -> tuple[float, float, float, float] | None:
    """(x_min, y_min, x_max, y_max) clipped to [0, 1]; None when nothing is left."""
    x0, y0 = _clip(region["x_min"]), _clip(region["y_min"])
    x1, y1 = _clip(region["x_max"]), _clip(region["y_max"])
    return (x0, y0, x1, y1) if x1 > x0 and y1 > y0 else None


def write_yolo(folder: Path, found: Answers, objects: Sequence[str]) -> int:
    """``folder/classes.txt`` (the objects, one a line: line n is class n) and a label file
    per picture under ``folder/labels/``: ``class x_center y_center width height`` a line,
    normalized to [0, 1]. Returns the pictures written."""
    classes = {name: i for i, name in enumerate(objects)}
    labels = folder / "labels"
    labels.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "classes.txt", "".join(f"{name}\n" for name in objects))
    for picture, per_object in found.items():
        rows = []
        for obj, body in per_object:
            for region in body["objects"]:
                box = _box(region)
                if box is not None:
                    x0, y0, x1, y1 = box
                    xc, yc, w, h = (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0
                    rows.append(f"{classes[obj]} {xc:.6f} {yc:.6f} {w:.6f} {h:.6f}\n")
        path = labels / yolo_label(picture)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, "".join(rows))
    return len(found)


def write_coco(
    path: Path,
    pictures: Path,
    found: Answers,
    objects: Sequence[str],
    task: str,
    limits: ImageLimits,
) -> int:
    """One COCO JSON file: ``images`` (``file_name`` relative to the folder, the upright
    ``width`` and ``height``), ``categories`` and ``annotations`` in pixels: detect's boxes
    as ``bbox`` [x, y, width, height]; point's points as ``keypoints`` [x, y, 2] (category
    keypoints ``["point"]``, ``bbox`` [x, y, 0, 0]). Returns the pictures written (one whose
    header cannot be read is left out)."""
    categories: list[dict[str, Any]] = []
    for i, name in enumerate(objects):
        category: dict[str, Any] = {"id": i + 1, "name": name, "supercategory": "object"}
        if task == "point":
            category.update(keypoints=["point"], skeleton=[])
        categories.append(category)
    ids = {name: i + 1 for i, name in enumerate(objects)}
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for picture, per_object in found.items():
        size = _size(pictures / picture, limits)
        if size is None:
            continue
        height, width = size
        image_id = len(images) + 1
        images.append({"id": image_id, "file_name": picture, "width": width, "height": height})
        for obj, body in per_object:
            base = {"image_id": image_id, "category_id": ids[obj], "iscrowd": 0}
            for mark in _marks(body, task, width, height):
                annotations.append({"id": len(annotations) + 1, **base, **mark})
    coco = {
        "info": {"description": f"vlm batch {task}"},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }
    _write_atomic(path, json.dumps(coco, ensure_ascii=False))
    return len(images)


def _marks(body: dict[str, Any], task: str, width: int, height: int) -> list[dict[str, Any]]:
    """A detect or point answer's annotations, in pixels."""
    out: list[dict[str, Any]] = []
    if task == "point":
        for p in body["points"]:
            x, y = round(_clip(p["x"]) * width, 2), round(_clip(p["y"]) * height, 2)
            point = {"keypoints": [x, y, 2], "num_keypoints": 1, "bbox": [x, y, 0, 0]}
            out.append({**point, "area": 0})
        return out
    for region in body["objects"]:
        box = _box(region)
        if box is None:
            continue
        x0, y0, x1, y1 = box
        w, h = round((x1 - x0) * width, 2), round((y1 - y0) * height, 2)
        bbox = [round(x0 * width, 2), round(y0 * height, 2), w, h]
        out.append({"bbox": bbox, "area": round(w * h, 2)})
    return out


def _size(path: Path, limits: ImageLimits) -> tuple[int, int] | None:
    """(height, width) of the picture as the model saw it (upright), or None."""
    try:
        return read_header(path.read_bytes(), limits).size
    except (OSError, ImageError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: a reader sees the old file or the new one."""
    part = path.with_name(path.name + ".part")
    part.write_text(text, encoding="utf-8")
    os.replace(part, path)
