"""``vlm batch`` on the tiny model: a folder of pictures per task, a requests file, the COCO and
YOLO files, error lines for pictures that cannot be read, refusals before running, exit codes
and the progress it shows. The command runs in this process (its kill and signal behaviour:
test_batch_crash.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from image_pipeline import DEFAULT_LIMITS, sample_image_bytes
from tests.support.batch_files import engine_flags, write_pictures
from vlm_server.bulk.exports import answers, export_path, write_coco, write_yolo, yolo_clash
from vlm_server.bulk.folder import FolderSource, PictureLine, list_pictures, picture_lines
from vlm_server.bulk.lines import BatchRequest, LineError, succeeded
from vlm_server.bulk.progress_view import ERASE_LINE, ProgressView
from vlm_server.bulk.read_ahead import read_ahead
from vlm_server.bulk.request_file import RequestFileError, RequestSource, scan
from vlm_server.bulk.results import read_results
from vlm_server.bulk.runner import Progress
from vlm_server.cli import main as cli_main

IMAGE = "data:image/jpeg;base64," + base64.b64encode(sample_image_bytes()).decode()
SHORT = ["--max-tokens", "3", "--temperature", "0"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("photos")
    names = write_pictures(folder, 6)
    (folder / "notes.txt").write_text("not a picture")
    return folder, names


def _batch(args: list[str], tiny_dir: Path) -> int:
    return cli_main(["batch", *args, *engine_flags(tiny_dir)])


def _results(path: Path) -> dict[str, dict[str, Any]]:
    rows = read_results(path)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a custom_id written twice"
    return {r["custom_id"]: r for r in rows}


# ---- folders, end to end ------------------------------------------------------------------


def test_caption_folder_then_a_rerun_skips_it_all(
    photos: tuple[Path, list[str]],
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, names = photos
    out = tmp_path / "captions.jsonl"
    assert (
        _batch(["caption", str(folder), "-o", str(out), "--length", "short", *SHORT], tiny_dir) == 0
    )
    got = _results(out)
    assert sorted(got) == names  # every picture, by its path in the folder
    for line in got.values():
        assert succeeded(line) and isinstance(line["response"]["body"]["caption"], str)
        assert line["response"]["body"]["metrics"]["output_tokens"] <= 3
    err = capsys.readouterr().err
    assert f"{len(names)} completed, 0 failed, 0 skipped" in err
    before = out.read_bytes()
    assert _batch(["caption", str(folder), "-o", str(out), *SHORT], tiny_dir) == 0
    assert out.read_bytes() == before
    assert f"0 completed, 0 failed, {len(names)} skipped" in capsys.readouterr().err


def test_query_folder_asks_the_question(
    photos: tuple[Path, list[str]], tiny_dir: Path, tmp_path: Path
) -> None:
    folder, names = photos
    out = tmp_path / "answers.jsonl"
    args = ["query", str(folder), "--question", "what colour is it?", "-o", str(out), *SHORT]
    assert _batch(args, tiny_dir) == 0
    got = _results(out)
    assert sorted(got) == names
    assert all(isinstance(r["response"]["body"]["answer"], str) for r in got.values())


def test_detect_folder_writes_coco_and_yolo_from_its_results(
    photos: tuple[Path, list[str]], tiny_dir: Path, tmp_path: Path
) -> None:
    folder, names = photos
    out = tmp_path / "boxes.jsonl"
    objects = ["car", "dog"]
    args = ["detect", str(folder), "-o", str(out), "--object", "car", "--object", "dog"]
    assert _batch([*args, "--max-objects", "3", "--format", "coco"], tiny_dir) == 0
    got = _results(out)
    assert sorted(got) == sorted(f"{n}#{o}" for n in names for o in objects)
    coco = json.loads((tmp_path / "boxes.coco.json").read_text())
    assert [c["name"] for c in coco["categories"]] == objects
    assert [i["file_name"] for i in coco["images"]] == names
    expected = []
    for image in coco["images"]:
        w, h = image["width"], image["height"]
        assert (w, h) == _size(folder / image["file_name"])
        for cat, obj in enumerate(objects, 1):
            for box in got[f"{image['file_name']}#{obj}"]["response"]["body"]["objects"]:
                x0, y0, x1, y1 = (_clip(box[k]) for k in ("x_min", "y_min", "x_max", "y_max"))
                if x1 > x0 and y1 > y0:
                    bbox = [x0 * w, y0 * h, (x1 - x0) * w, (y1 - y0) * h]
                    expected.append((image["id"], cat, bbox))
    found = [(a["image_id"], a["category_id"], a["bbox"]) for a in coco["annotations"]]
    assert expected, "the tiny model found nothing: the check would be empty"
    assert len(found) == len(expected)
    for (fi, fc, fb), (ei, ec, eb) in zip(found, expected, strict=True):
        assert (fi, fc) == (ei, ec) and fb == pytest.approx(eb, abs=0.01)
    # The same output again, as YOLO: nothing runs again, the labels come from the file.
    assert _batch([*args, "--format", "yolo"], tiny_dir) == 0
    yolo = tmp_path / "boxes.yolo"
    assert (yolo / "classes.txt").read_text() == "car\ndog\n"
    for name in names:
        rows = [
            r.split()
            for r in (yolo / "labels" / Path(name).with_suffix(".txt")).read_text().splitlines()
        ]
        want = []
        for cls, obj in enumerate(objects):
            for box in got[f"{name}#{obj}"]["response"]["body"]["objects"]:
                x0, y0, x1, y1 = (_clip(box[k]) for k in ("x_min", "y_min", "x_max", "y_max"))
                if x1 > x0 and y1 > y0:
                    want.append([cls, (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
        assert [int(r[0]) for r in rows] == [w[0] for w in want]
        for row, w in zip(rows, want, strict=True):
            assert [float(v) for v in row[1:]] == pytest.approx(w[1:], abs=1e-5)
            assert all(0 <= float(v) <= 1 for v in row[1:])


def test_point_folder_writes_coco_keypoints(
    photos: tuple[Path, list[str]], tiny_dir: Path, tmp_path: Path
) -> None:
    folder, names = photos
    out = tmp_path / "points.jsonl"
    args = ["point", str(folder), "-o", str(out), "--object", "cat", "--format", "coco"]
    assert _batch([*args, "--max-objects", "2"], tiny_dir) == 0
    got = _results(out)
    coco = json.loads((tmp_path / "points.coco.json").read_text())
    assert coco["categories"] == [
        {"id": 1, "name": "cat", "supercategory": "object", "keypoints": ["point"], "skeleton": []}
    ]
    by_image = {i["id"]: i for i in coco["images"]}
    points = [
        (image["file_name"], p)
        for image in coco["images"]
        for p in got[image["file_name"]]["response"]["body"]["points"]
    ]
    assert len(points) == len(coco["annotations"])
    for (name, p), a in zip(points, coco["annotations"], strict=True):
        image = by_image[a["image_id"]]
        assert image["file_name"] == name and a["num_keypoints"] == 1
        x, y, visible = a["keypoints"]
        assert visible == 2
        assert x == pytest.approx(_clip(p["x"]) * image["width"], abs=0.01)
        assert y == pytest.approx(_clip(p["y"]) * image["height"], abs=0.01)
    assert sorted(got) == names


def test_segment_folder(photos: tuple[Path, list[str]], tiny_dir: Path, tmp_path: Path) -> None:
    folder, names = photos
    out = tmp_path / "outlines.jsonl"
    args = ["segment", str(folder), "-o", str(out), "--object", "cat", "--max-tokens", "8"]
    assert _batch(args, tiny_dir) == 0
    got = _results(out)
    assert sorted(got) == names
    assert all(isinstance(r["response"]["body"]["path"], str) for r in got.values())


def test_unreadable_pictures_become_error_lines_and_the_rest_goes_on(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "photos"
    names = write_pictures(folder, 3)
    (folder / "broken.jpg").write_bytes(b"these bytes are no picture")
    (folder / "gone.png").symlink_to(tmp_path / "nowhere.png")  # listed, cannot be read
    out = tmp_path / "out.jsonl"
    assert _batch(["caption", str(folder), "-o", str(out), *SHORT], tiny_dir) == 1
    got = _results(out)
    assert sorted(got) == sorted([*names, "broken.jpg", "gone.png"])
    gone = got["gone.png"]
    assert gone["response"] is None and gone["error"]["field"] == "image_url"
    assert str(folder / "gone.png") in gone["error"]["message"]
    broken = got["broken.jpg"]["response"]
    assert broken["status_code"] == 400 and broken["body"]["error"]["field"] == "image_url"
    assert all(succeeded(got[n]) for n in names)
    err = capsys.readouterr().err
    assert f"{len(names)} completed, 2 failed" in err and "2 of 5 results are errors" in err
    # A rerun writes nothing again, and still says the results hold errors.
    assert _batch(["caption", str(folder), "-o", str(out), *SHORT], tiny_dir) == 1
    assert len(read_results(out)) == len(names) + 2


# ---- requests files -----------------------------------------------------------------------


def _request(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_requests_file_answers_in_the_openai_output_shape(tiny_dir: Path, tmp_path: Path) -> None:
    settings = {"temperature": 0, "max_tokens": 3}
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": IMAGE}},
                ],
            }
        ],
        "max_tokens": 3,
    }
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "\n".join(
            [
                _request("cap", "/v1/caption", {"image_url": IMAGE, "settings": settings}),
                "",  # blank lines are skipped
                _request(
                    "ask",
                    "/v1/query",
                    {"image_url": IMAGE, "question": "hi?", "settings": settings},
                ),
                _request("chat", "/v1/chat/completions", chat),
                _request("lost", "/v1/nowhere", {}),
                _request("odd", "/v1/detect", {"image_url": IMAGE, "object": "x", "colour": 1}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "results.jsonl"
    assert _batch([str(requests), "-o", str(out)], tiny_dir) == 1  # two lines are errors
    got = _results(out)
    assert sorted(got) == ["ask", "cap", "chat", "lost", "odd"]
    for custom_id in ("cap", "ask", "chat"):
        line = got[custom_id]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
    assert isinstance(got["cap"]["response"]["body"]["caption"], str)
    assert isinstance(got["ask"]["response"]["body"]["answer"], str)
    assert got["chat"]["response"]["body"]["object"] == "chat.completion"
    assert got["lost"]["response"] is None and got["lost"]["error"]["field"] == "url"
    odd = got["odd"]["response"]
    assert odd["status_code"] == 400 and odd["body"]["error"]["field"] == "colour"


def test_duplicate_custom_ids_are_refused_before_anything_runs(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = {"image_url": IMAGE}
    requests = tmp_path / "requests.jsonl"
    lines = [_request(c, "/v1/caption", body) for c in ("a", "b", "c", "b")]
    requests.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    assert _batch([str(requests), "-o", str(out)], tiny_dir) == 2
    err = capsys.readouterr().err
    assert "custom_id 'b' is on line 2 and line 4" in err
    assert not out.exists()


def test_a_line_without_a_custom_id_is_refused_naming_it(tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(_request("a", "/v1/caption", {}) + "\n\nnot json\n")
    with pytest.raises(RequestFileError, match=r"line 3: line: not JSON"):
        scan(requests)
    requests.write_text(json.dumps({"url": "/v1/caption", "body": {}}) + "\n")
    with pytest.raises(RequestFileError, match=r"line 1: custom_id: required"):
        scan(requests)


def test_a_requests_line_is_read_from_its_place_on_a_thread(tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    lines = [_request("a", "/v1/query", {"question": "é?"}), _request("b", "/v1/x", {})]
    requests.write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = RequestSource(requests, scan(requests))
    try:
        assert source.ids == ["a", "b"]
        assert source.make(source.lines[0]) == BatchRequest("a", "/v1/query", {"question": "é?"})
        custom_id, err = source.make(source.lines[1])  # type: ignore[misc]
        assert custom_id == "b" and isinstance(err, LineError) and err.field == "url"
    finally:
        source.close()


# ---- refusals and exit codes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["detect", "{folder}"], "--object: required by detect"),
        (["query", "{folder}"], "--question: required by query"),
        (["caption", "{folder}", "--object", "car"], "--object: a flag of point"),
        (["caption", "{folder}", "--format", "coco"], "--format coco: caption writes jsonl"),
        (["segment", "{folder}", "--object", "a", "--format", "yolo"], "segment writes jsonl"),
        (["point", "{folder}", "--object", "a", "--format", "yolo"], "jsonl or coco"),
        (["detect", "{folder}", "--object", "a", "--object", "a"], "the same object twice"),
        (["caption"], "caption takes one folder"),
        (["{requests}", "--question", "hi"], "--question: a requests file's lines"),
        (["caption", "{folder}", "--concurrency", "0"], "--concurrency: must be >= 1"),
        (["caption", "{folder}", "--port", "1"], "unrecognized arguments: --port"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    photos: tuple[Path, list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    words: str,
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(_request("a", "/v1/caption", {}) + "\n")
    filled = [a.format(folder=photos[0], requests=requests) for a in args]
    with pytest.raises(SystemExit) as exited:
        cli_main(["batch", *filled, "-o", str(tmp_path / "out.jsonl")])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_inputs_that_cannot_run_exit_2_before_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out.jsonl"
    assert cli_main(["batch", "caption", str(empty), "-o", str(out)]) == 2
    assert "no pictures in it" in capsys.readouterr().err
    assert cli_main(["batch", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    assert "missing.jsonl: No such file" in capsys.readouterr().err
    requests = tmp_path / "requests.jsonl"
    requests.write_text(_request("a", "/v1/caption", {}) + "\n")
    with pytest.raises(SystemExit):  # the input given as the output
        cli_main(["batch", str(requests), "-o", str(requests)])
    assert "the requests file itself" in capsys.readouterr().err
    (tmp_path / "pics").mkdir()
    write_pictures(tmp_path / "pics", 1)
    other = tmp_path / "other.jsonl"
    other.write_text('{"some": "file"}\n')
    assert cli_main(["batch", "caption", str(tmp_path / "pics"), "-o", str(other)]) == 2
    assert "not a result line" in capsys.readouterr().err
    assert other.read_text() == '{"some": "file"}\n'
    args = ["caption", str(tmp_path / "pics"), "-o", str(out), "--model", str(tmp_path / "no")]
    assert cli_main(["batch", *args, "--device", "cpu"]) == 1
    assert "the engine did not start: model source" in capsys.readouterr().err


# ---- the parts ------------------------------------------------------------------------------


def test_pictures_are_listed_recursively_sorted_by_extension(tmp_path: Path) -> None:
    for name in ["b.JPG", "a/c.png", "a/z.tiff", "d.webp", "e.bmp", "f.gif", "g.tif", "h.jpeg"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "dir.png").mkdir()  # a folder named like a picture is no picture
    assert list_pictures(tmp_path) == [
        "a/c.png", "a/z.tiff", "b.JPG", "d.webp", "e.bmp", "f.gif", "g.tif", "h.jpeg",
    ]  # fmt: skip
    assert [line.custom_id for line in picture_lines(["p.jpg"], ["car", "dog"])] == [
        "p.jpg#car",
        "p.jpg#dog",
    ]
    assert picture_lines(["p.jpg"], ["car"]) == [PictureLine("p.jpg", "p.jpg", "car")]
    with pytest.raises(ValueError, match="not a folder"):
        list_pictures(tmp_path / "notes.txt")


def test_a_picture_becomes_its_body_or_an_error_line(tmp_path: Path) -> None:
    data = sample_image_bytes()
    (tmp_path / "a.jpg").write_bytes(data)
    (tmp_path / "big.png").write_bytes(b"x" * (len(data) + 1))
    fields = {"question": "why?", "settings": {"max_tokens": 5, "seed": 3}}
    source = FolderSource(
        tmp_path,
        picture_lines(["a.jpg", "big.png", "gone.jpg"], ["car"]),
        "/v1/query",
        fields,
        len(data),
    )
    made = source.make(source.lines[0])
    assert isinstance(made, BatchRequest) and made.url == "/v1/query"
    assert made.body["question"] == "why?" and made.body["object"] == "car"
    assert made.body["settings"] == {"max_tokens": 5, "seed": 3}
    head, payload = made.body["image_url"].split(",", 1)
    assert head == "data:image/jpeg;base64" and base64.b64decode(payload) == data
    big = source.make(source.lines[1])
    assert not isinstance(big, BatchRequest) and big[1].code == "image_too_large"
    gone = source.make(source.lines[2])
    assert not isinstance(gone, BatchRequest) and gone[1].field == "image_url"
    assert "gone.jpg" in str(gone[1])


def test_read_ahead_runs_off_the_loop_in_order_and_no_further_than_asked(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    started: list[int] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def make(job: int) -> int:
        with lock:
            started.append(job)
            threads.add(threading.get_ident())
        return job * 10

    async def go() -> list[int]:
        got = []
        with ThreadPoolExecutor(2) as pool:
            async for value in read_ahead(range(20), make, 3, pool):
                assert len(started) <= len(got) + 3 + 1  # taken, and three ahead
                got.append(value)
                await asyncio.sleep(0)
        return got

    assert asyncio.run(go()) == [j * 10 for j in range(20)]
    assert threading.get_ident() not in threads


def test_coco_and_yolo_clip_to_the_picture_and_drop_what_is_left_empty(tmp_path: Path) -> None:
    (tmp_path / "p.jpg").write_bytes(sample_image_bytes())
    lines = picture_lines(["p.jpg", "q.jpg"], ["car"])
    body = {"objects": [
        {"x_min": -0.2, "y_min": 0.1, "x_max": 0.4, "y_max": 1.3},  # clipped
        {"x_min": 1.1, "y_min": 0.2, "x_max": 1.4, "y_max": 0.5},  # wholly outside: dropped
    ]}  # fmt: skip
    ok = {"custom_id": "p.jpg", "response": {"status_code": 200, "body": body}, "error": None}
    bad = {"custom_id": "q.jpg", "response": {"status_code": 400, "body": {}}, "error": None}
    found = answers(lines, {"p.jpg": ok, "q.jpg": bad})
    assert list(found) == ["p.jpg"]  # a failed picture is left out, not exported empty
    coco_path = export_path(tmp_path / "boxes.jsonl", "coco")
    assert coco_path == tmp_path / "boxes.coco.json"
    assert write_coco(coco_path, tmp_path, found, ["car"], "detect", DEFAULT_LIMITS) == 1
    coco = json.loads(coco_path.read_text())
    w, h = coco["images"][0]["width"], coco["images"][0]["height"]
    assert (w, h) == _size(tmp_path / "p.jpg")
    [annotation] = coco["annotations"]
    assert annotation["bbox"] == pytest.approx([0, 0.1 * h, 0.4 * w, 0.9 * h], abs=0.01)
    yolo_path = export_path(tmp_path / "boxes.jsonl", "yolo")
    assert write_yolo(yolo_path, found, ["car"]) == 1
    [row] = (yolo_path / "labels" / "p.txt").read_text().splitlines()
    assert row == "0 0.200000 0.550000 0.400000 0.900000"
    assert yolo_clash(["a/x.jpg", "a/x.png"]) == ("a/x.jpg", "a/x.png")
    assert yolo_clash(["a/x.jpg", "b/x.png"]) is None


def test_progress_redraws_one_line_on_a_terminal_and_prints_lines_elsewhere() -> None:
    import io

    now = [0.0]
    p = Progress(total=10, started=0.0)
    p.completed, p.failed, p.output_tokens = 3, 1, 40
    tty = io.StringIO()
    view = ProgressView(tty, True, 10.0, "vlm batch: ", clock=lambda: now[0])
    view.update(p)
    view.update(p)  # within the redraw interval: not drawn again
    now[0] = 1.0
    view.update(p)
    view.end("done")
    text = tty.getvalue()
    assert text.count(ERASE_LINE) == 2 and text.endswith("\nvlm batch: done\n")
    assert "4/10 lines (40%)" in text and "1 failed" in text and "ETA" in text
    plain = io.StringIO()
    view = ProgressView(plain, False, 10.0, clock=lambda: now[0])
    for t in (1.0, 5.0, 11.5, 12.0):
        now[0] = t
        view.update(p)
    assert plain.getvalue().count("\n") == 2 and ERASE_LINE not in plain.getvalue()


def _clip(v: float) -> float:
    return min(1.0, max(0.0, v))


def _size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size
