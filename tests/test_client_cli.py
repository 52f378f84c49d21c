"""``vlm-client`` against a real loopback server (the batched engine, the server's default),
and the drawing of results."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from image_pipeline import PreparedImage, sample_image_bytes
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.client import AsyncVisionLanguageClient, RleMask, TextDelta, VlmError
from vlm_server.client import Point as ClientPoint
from vlm_server.client.cli import main
from vlm_server.client.draw import COLOR, render, rle_decode
from vlm_server.engine.api import (
    Box,
    EngineInfo,
    EngineStats,
    Finished,
    GenerationRequest,
    Point,
    Segmentation,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    factory = in_process(lambda: GatedBatchedEngine(tiny, EngineConfig(kv_budget_bytes=16 << 20)))
    with ServerThread(local_config(), factory) as running:
        yield running


def cli(
    server: ServerThread, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    code = main([*args, "--target", server.target, "--timeout", "60"])
    out, err = capsys.readouterr()
    return code, out, err


def test_caption_stream_prints_the_reference_text(
    server: ServerThread,
    capsys: pytest.CaptureFixture[str],
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
) -> None:
    code, out, _ = cli(
        server, capsys, "caption", "sample", "--stream", "--temperature", "0", "--max-tokens", "8"
    )
    want = generator.caption(sample_image, "normal", SamplingSettings(temperature=0, max_tokens=8))
    assert code == 0 and out == want.text + "\n"


def test_query_without_image_as_json(
    server: ServerThread, capsys: pytest.CaptureFixture[str], generator: ReferenceGenerator
) -> None:
    code, out, _ = cli(
        server, capsys, "query", "none", "why?", "--json", "--temperature", "0", "--max-tokens", "5"
    )
    result = json.loads(out)
    want = generator.query(None, "why?", SamplingSettings(temperature=0, max_tokens=5))
    assert code == 0 and result["text"] == want.text and result["finish_reason"] == "length"
    assert result["metrics"]["output_tokens"] == 5


def test_detect_json_and_point_drawing(
    server: ServerThread,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
) -> None:
    image = tmp_path / "photo.jpg"
    image.write_bytes(sample_image_bytes())
    code, out, _ = cli(server, capsys, "detect", str(image), "car", "--json")
    want = generator.detect(sample_image, "car")
    assert code == 0
    assert [tuple(b.values()) for b in json.loads(out)["boxes"]] == [
        (b.x_min, b.y_min, b.x_max, b.y_max) for b in want.boxes
    ]
    drawn = tmp_path / "points.png"
    code, out, _ = cli(server, capsys, "point", str(image), "sun", "--draw", str(drawn))
    points = generator.point(sample_image, "sun").points
    assert code == 0 and f"({len(points)} points" in out
    picture = Image.open(drawn)
    assert picture.size == (800, 600)
    for p in points:
        x, y = min(int(p.x * 800), 799), min(int(p.y * 600), 599)
        assert picture.getpixel((x, y)) == COLOR


def test_encode_then_use_the_id(
    server: ServerThread, capsys: pytest.CaptureFixture[str], sample_image: PreparedImage
) -> None:
    code, out, _ = cli(server, capsys, "encode", "sample")
    assert code == 0 and out.strip() == f"id:{sample_image.content_hash}"
    code, out, _ = cli(server, capsys, "caption", out.strip(), "--max-tokens", "3")
    assert code == 0 and out.strip()


def test_info_lists_the_model(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(server, capsys, "info")
    assert code == 0 and "model_name: tiny" in out and "max_message_bytes: 33554432" in out


def test_errors_exit_1_with_code_and_field(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(server, capsys, "caption", "sample", "--temperature", "-1")
    assert code == 1
    assert "INVALID_ARGUMENT" in err and "settings.temperature" in err
    code, _, err = cli(server, capsys, "query", "sample", "q", "--regex", "(")
    assert code == 1 and "regex" in err


def test_unreachable_server_is_unavailable(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["info", "--target", "127.0.0.1:1", "--timeout", "10"])
    assert code == 1 and "UNAVAILABLE" in capsys.readouterr().err


def test_async_client_stream_stops_early_and_cancels(server: ServerThread) -> None:
    async def body() -> list[Any]:
        async with AsyncVisionLanguageClient(server.target, timeout=60) as client:
            seen = []
            async for event in client.query_stream(
                None, "a long story", temperature=0, max_tokens=1500
            ):
                seen.append(event)
                if len(seen) == 2:
                    break
            with pytest.raises(VlmError):
                await client.point(b"not an image", "x")
            return seen

    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    ended = len(engine.outcomes)
    seen = asyncio.run(body())
    assert all(isinstance(e, TextDelta) for e in seen)
    wait_for(lambda: len(engine.outcomes) > ended, what="the cancel to reach the engine")
    assert list(engine.outcomes.values())[ended:] == ["CANCELLED"]
    wait_for(engine.idle, what="an idle engine")
    assert engine.scheduler.pages.used_pages == engine.cached_prefix_pages()


def test_segment_json_from_the_batched_engine(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(server, capsys, "segment", "sample", "house", "--json")
    result = json.loads(out)
    assert code == 0 and result["svg_path"].startswith("M") and result["polygons"]
    assert (result["mask"]["height"], result["mask"]["width"]) == (600, 800)
    assert sum(result["mask"]["counts"]) == 600 * 800


# ---- segment drawing, through an engine that answers a known outline -----------------------


def rle_encode(mask: np.ndarray) -> list[int]:
    """COCO RLE counts of a bool mask (column-major, background first)."""
    counts, current, run = [], False, 0
    for value in mask.T.reshape(-1).tolist():
        if value == current:
            run += 1
        else:
            counts.append(run)
            current, run = value, 1
    counts.append(run)
    return counts


SQUARE = ((0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75))


class SegmentOnlyEngine:
    """A minimal `Engine` answering every request with one fixed square outline."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.info = EngineInfo("fake", "fake", "fake", "cpu", "fp32", 1, 1, 2048, 8)
        self.size = size

    async def start(self) -> None:
        return None

    async def submit(self, request: GenerationRequest) -> Any:
        w, h = self.size
        mask = np.zeros((h, w), dtype=bool)
        mask[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = True
        seg = Segmentation(
            box=Box(0.25, 0.25, 0.75, 0.75),
            svg_path="M0.25,0.25 H0.75 V0.75 H0.25 Z",
            polygons=(tuple(Point(x, y) for x, y in SQUARE),),
            mask_rle=tuple(rle_encode(mask)),
            mask_height=h,
            mask_width=w,
        )
        done = Finished(finish_reason="eos", segmentation=seg)

        class Stream:
            async def __aiter__(self) -> Any:
                yield done

            def cancel(self) -> None:
                return None

        return Stream()

    def stats(self) -> EngineStats:
        return EngineStats()

    def warm_constraints(self) -> None:
        return None

    def watch_events_delay(self, observe: Callable[[float], None]) -> None:
        return None

    def failure(self) -> str | None:
        return None

    async def drain(self, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None


def test_segment_end_to_end_with_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = tmp_path / "white.png"
    Image.new("RGB", (80, 60), (255, 255, 255)).save(image)
    with ServerThread(local_config(), lambda: SegmentOnlyEngine((80, 60))) as fake:
        out_png = tmp_path / "seg.png"
        code, out, _ = cli(fake, capsys, "segment", str(image), "dog", "--draw", str(out_png))
        assert code == 0 and "1 polygons, mask 60x80" in out
        code, out, _ = cli(fake, capsys, "segment", str(image), "dog", "--json")
    result = json.loads(out)
    assert result["box"] == {"x_min": 0.25, "y_min": 0.25, "x_max": 0.75, "y_max": 0.75}
    assert result["mask"]["height"] == 60 and result["svg_path"].startswith("M0.25")
    drawn = np.asarray(Image.open(out_png).convert("RGB"))
    assert tuple(drawn[30, 40]) != (255, 255, 255)  # inside the mask: tinted
    assert tuple(drawn[2, 2]) == (255, 255, 255)  # outside: untouched


def test_rle_round_trip_and_render_of_points_and_boxes() -> None:
    rng = np.random.default_rng(0)
    mask = rng.random((7, 5)) > 0.5
    counts = rle_encode(mask)
    assert np.array_equal(rle_decode(RleMask(counts, 7, 5)), mask)
    with pytest.raises(ValueError):
        rle_decode(RleMask([3, 4], 7, 5))
    picture = render(Image.new("RGB", (100, 100)), points=[ClientPoint(0.5, 0.5)])
    assert picture.getpixel((50, 50)) == COLOR
