"""A segment refiner in the engine (engine/segment_finisher.py) on the tiny Moondream 3 model: the
streamed box and deltas stay the decoded ones, the final event carries the refiner's answer,
and a refiner that keeps nothing or fails leaves the decoded segment; the family's refiner
from a file, and the errors that name the flag."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.segment_output import SegmentResult
from image_pipeline import EncodedImage, ImagePreparer, PreparedImage, sample_image
from image_pipeline.prepared import prepare_pil
from tests.support.hub_cache import hub_snapshot, run_offline
from tests.test_engine import _wait_idle
from tests.test_moondream3_segment import _stream
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    PathDelta,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.outputs import SvgSegmentOutput
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.segment_finisher import decoded_segment, pixels_of
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream3.refiner import save_head
from vlm_server.models.moondream3.refiner_head import random_head
from vlm_server.models.registry import preset, random_model, segment_refiner
from vlm_server.server.in_process import InProcessEngine


@pytest.fixture(scope="module")
def md3_tiny() -> LoadedModel:
    return random_model(preset("md3-tiny"), seed=0, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def picture() -> tuple[PreparedImage, np.ndarray]:
    """A prepared picture that kept its pixels, and those pixels."""
    base = sample_image().resize((300, 200))
    pixels = np.array(base.convert("RGB"))
    return dataclasses.replace(prepare_pil(base), source=pixels), pixels


def _run(loaded: LoadedModel, reqs: list[GenerationRequest], refine: object, depth: int = 2):
    async def run() -> list[tuple[list, Finished]]:
        cfg = EngineConfig(max_batch_size=4, pipeline_depth=depth)
        engine = InProcessEngine(BatchedEngine(loaded, cfg, segment_refiner=refine))  # type: ignore[arg-type]
        await engine.start()
        try:
            out = await asyncio.gather(*[_stream(engine, r) for r in reqs])
            await _wait_idle(engine)
            return out
        finally:
            await engine.close()

    return asyncio.run(run())


def _moved(seg: SegmentResult) -> SegmentResult:
    x0, y0, x1, y1 = seg.box
    return dataclasses.replace(seg, box=(x0 / 2, y0 / 2, x1 / 2, y1 / 2), box_path="M0,0z")


@pytest.mark.parametrize("depth", [1, 2])
def test_the_final_event_carries_the_refined_segment(
    md3_tiny: LoadedModel, picture: tuple[PreparedImage, np.ndarray], depth: int
) -> None:
    image, pixels = picture
    reqs = [
        GenerationRequest(Task.SEGMENT, image, object_name=name, max_tokens=30)
        for name in ("car", "tree")
    ] + [GenerationRequest(Task.DETECT, image, object_name="car", max_objects=3)]
    plain = _run(md3_tiny, reqs, None, depth)
    seen: list[tuple[np.ndarray, SegmentResult, str]] = []

    def refine(px: np.ndarray, coarse: SegmentResult) -> SegmentResult | None:
        seen.append((px, coarse, threading.current_thread().name))
        return _moved(coarse)

    refined = _run(md3_tiny, reqs, refine, depth)
    assert len(seen) == 2 and all(np.array_equal(px, pixels) for px, _, _ in seen)
    assert {name for *_, name in seen} == {"segment-finisher"}  # off the scheduler's thread
    for (deltas, fin), (want_deltas, want) in zip(refined[:2], plain[:2], strict=True):
        assert deltas == want_deltas and all(isinstance(d, PathDelta) for d in deltas)
        assert fin.points == want.points and fin.finish_reason == want.finish_reason
        assert want.segmentation is not None and fin.segmentation is not None
        moved = _moved(decoded_segment(want.segmentation))
        assert fin.segmentation.box_path == "M0,0z"
        got_box = fin.segmentation.box
        assert (got_box.x_min, got_box.y_min, got_box.x_max, got_box.y_max) == moved.box
    assert refined[2][1].boxes == plain[2][1].boxes  # other tasks never wait for it


def test_a_refiner_that_keeps_nothing_or_fails_leaves_the_decoded_segment(
    md3_tiny: LoadedModel, picture: tuple[PreparedImage, np.ndarray]
) -> None:
    image, _ = picture
    reqs = [GenerationRequest(Task.SEGMENT, image, object_name="car", max_tokens=30)]
    want = _run(md3_tiny, reqs, None)[0][1].segmentation

    def nothing(px: np.ndarray, coarse: SegmentResult) -> None:
        return None

    def broken(px: np.ndarray, coarse: SegmentResult) -> SegmentResult:
        raise RuntimeError("the refiner broke")

    for refine in (nothing, broken):
        assert _run(md3_tiny, reqs, refine)[0][1].segmentation == want
    bare = dataclasses.replace(image, source=None)  # pixels not kept: the decoded answer
    reqs = [GenerationRequest(Task.SEGMENT, bare, object_name="car", max_tokens=30)]
    assert _run(md3_tiny, reqs, _moved)[0][1].segmentation == want


def test_pixels_come_from_each_kind_of_image(picture: tuple[PreparedImage, np.ndarray]) -> None:
    image, pixels = picture
    preparer = ImagePreparer()
    assert pixels_of(image, preparer) is pixels
    kept = ImagePreparer(keep_source=True)
    from image_pipeline import sample_image_bytes

    data = sample_image_bytes()
    prepared = kept.prepare(data)
    assert isinstance(prepared.source, np.ndarray)
    assert prepared.nbytes == prepared.crops.nbytes + prepared.source.nbytes
    assert np.array_equal(pixels_of(prepared, preparer), preparer.decode_host(data).pixels)
    host = preparer.decode_host(data)
    assert pixels_of(host, preparer) is host.pixels
    encoded = EncodedImage(data, host.tiling, "h", host.width, host.height, host.num_crops)
    assert np.array_equal(pixels_of(encoded, preparer), host.pixels)
    with pytest.raises(ValueError, match="not kept"):
        pixels_of(dataclasses.replace(image, source=None), preparer)


def test_the_familys_refiner_reads_its_file_and_errors_name_the_flag(
    md3_tiny: LoadedModel, tmp_path: Path, picture: tuple[PreparedImage, np.ndarray]
) -> None:
    vision = md3_tiny.model.config.vision
    head = random_head(seed=1, enc_dim=vision.enc_dim, grid=vision.grid_size)
    save_head(head, tmp_path / "model.pt")
    refine = segment_refiner(md3_tiny, tmp_path)  # a folder holding model.pt
    image, pixels = picture
    reqs = [GenerationRequest(Task.SEGMENT, image, object_name="car", max_tokens=30)]
    coarse = _run(md3_tiny, reqs, None)[0][1].segmentation
    assert coarse is not None
    out = refine(pixels, decoded_segment(coarse))
    if out is not None:  # random weights: a mask or none, well formed either way
        assert out.mask_size == (200, 300) and out.box_path and out.box_path.startswith("M")
    with pytest.raises(ValueError, match=r"segment_refiner: .*neither an existing path"):
        segment_refiner(md3_tiny, tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"segment_refiner: .*holds no model.pt"):
        segment_refiner(md3_tiny, tmp_path / "empty")
    save_head(random_head(enc_dim=vision.enc_dim, grid=vision.grid_size + 1), tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"segment_refiner: .*image_pe has shape"):
        segment_refiner(md3_tiny, tmp_path / "x.pt")
    md2 = random_model(preset("tiny"), seed=0, dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="--segment-refiner: the model 'tiny' has no segm"):
        segment_refiner(md2, tmp_path / "model.pt")


def test_the_refiner_resolves_from_a_hub_snapshot_offline(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    snap = hub_snapshot(tmp_path / "hub", "moondream/SegHeadRefiner")
    save_head(random_head(enc_dim=64, grid=27, width=64), snap / "model.pt")
    code = (
        "from vlm_server.models.hub import resolve_file\n"
        "print('found', resolve_file('moondream/SegHeadRefiner', 'model.pt').name)\n"
    )
    out = run_offline(code, tmp_path / "hub")
    assert out.returncode == 0, out.stderr
    assert "found model.pt" in out.stdout


def test_a_refiner_without_potracer_is_refused_at_start(
    md3_tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    vision = md3_tiny.model.config.vision
    save_head(random_head(enc_dim=vision.enc_dim, grid=vision.grid_size), tmp_path / "model.pt")
    monkeypatch.setitem(sys.modules, "potrace", None)  # not installed
    with pytest.raises(ValueError, match=r"segment_refiner: needs potracer"):
        segment_refiner(md3_tiny, tmp_path / "model.pt")


def test_segment_geometry_runs_off_the_scheduler_and_a_failure_ends_only_its_request(
    md3_tiny: LoadedModel, picture: tuple[PreparedImage, np.ndarray], monkeypatch
) -> None:
    """Without a refiner too, a segment's mask is built on the finisher's thread; geometry
    that raises ends that request with INTERNAL naming the cause, and the others answer."""
    image, _ = picture
    threads: list[str] = []
    built = SvgSegmentOutput.later

    def later(self: SvgSegmentOutput, result: Finished, request: GenerationRequest) -> None:
        threads.append(threading.current_thread().name)
        if request.object_name == "boom":
            raise ValueError("no mask for you")
        built(self, result, request)

    monkeypatch.setattr(SvgSegmentOutput, "later", later)
    reqs = [
        GenerationRequest(Task.SEGMENT, image, object_name=name, max_tokens=30)
        for name in ("car", "boom", "tree")
    ]

    async def run() -> list[tuple[list, Finished] | BaseException]:
        engine = InProcessEngine(BatchedEngine(md3_tiny, EngineConfig(max_batch_size=4)))
        await engine.start()
        try:
            out = await asyncio.gather(*[_stream(engine, r) for r in reqs], return_exceptions=True)
            await _wait_idle(engine)
            return out
        finally:
            await engine.close()

    car, boom, tree = asyncio.run(run())
    assert threads and set(threads) == {"segment-finisher"}
    assert isinstance(boom, EngineError) and boom.code == ErrorCode.INTERNAL
    assert "geometry failed: no mask for you" in str(boom)
    for answer in (car, tree):
        assert not isinstance(answer, BaseException)
        seg = answer[1].segmentation
        assert seg is not None and seg.mask_height == 200 and seg.mask_width == 300


def test_an_engine_failure_still_delivers_the_finished_segments(
    md3_tiny: LoadedModel, picture: tuple[PreparedImage, np.ndarray], monkeypatch
) -> None:
    """The scheduler thread fails while a finished segment's geometry is on the finisher:
    the running request gets INTERNAL naming the failure, the segment its complete answer."""
    image, _ = picture
    entered, release = threading.Event(), threading.Event()
    built = SvgSegmentOutput.later

    def later(self: SvgSegmentOutput, result: Finished, request: GenerationRequest) -> None:
        entered.set()
        assert release.wait(60)
        built(self, result, request)

    monkeypatch.setattr(SvgSegmentOutput, "later", later)
    segment = GenerationRequest(Task.SEGMENT, image, object_name="car", max_tokens=30)
    long = GenerationRequest(Task.CAPTION, image, max_tokens=1000, temperature=0)

    async def run() -> list[tuple[list, Finished] | BaseException]:
        batched = BatchedEngine(md3_tiny, EngineConfig(max_batch_size=4))
        engine = InProcessEngine(batched)
        await engine.start()
        try:
            tasks = [asyncio.ensure_future(_stream(engine, r)) for r in (segment, long)]
            assert await asyncio.to_thread(entered.wait, 60)  # a hang guard, not a timing

            def boom() -> None:
                raise RuntimeError("boom")

            batched.scheduler.tick = boom  # type: ignore[method-assign]
            for _ in range(6000):  # failed while the geometry is still running
                if batched.failure() is not None:
                    break
                await asyncio.sleep(0.01)
            release.set()
            done = asyncio.gather(*tasks, return_exceptions=True)
            return await asyncio.wait_for(done, 60)
        finally:
            await engine.close()

    seg, cap = asyncio.run(run())
    assert isinstance(cap, EngineError) and cap.code == ErrorCode.INTERNAL
    assert "engine failure: boom" in str(cap)
    assert not isinstance(seg, BaseException) and seg[1].segmentation is not None
