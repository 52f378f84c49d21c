"""Detect and segment boxes as the reference returns them (the decoded centre plus and minus
half the size, past the picture where the object is cut by its border), and the optional
``clip`` setting that clamps them, through both doors. The tiny model's size head is biased
to its largest bin, so every box is as wide and tall as the picture and crosses its edges."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import grpc
import pytest
import torch

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.reference_memo import shared_reference
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.api import Box, Finished, FinishReason, Point, Segmentation
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.outputs import clip_result
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator

MIB = 1 << 20


@pytest.fixture(scope="module")
def wide(tiny: LoadedModel) -> LoadedModel:
    model = copy.deepcopy(tiny.model)
    bias = model.region.size_decoder.fc2.bias
    bins = bias.shape[0] // 2
    with torch.no_grad():
        bias[bins - 1] += 1e4  # width: 2 ** 0, the whole picture
        bias[2 * bins - 1] += 1e4  # height
    return LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)


@pytest.fixture(scope="module")
def server(wide: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=4, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: BatchedEngine(wide, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


@pytest.fixture(scope="module")
def ref(wide: LoadedModel) -> ReferenceGenerator:
    return shared_reference(wide.model, wide.tokenizer)


@pytest.fixture(scope="module")
def picture() -> PreparedImage:
    return prepare_image(sample_image_bytes())


def _clamp(values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(min(max(v, 0.0), 1.0) for v in values)


def _outside(values: tuple[float, ...]) -> bool:
    return any(v < 0 or v > 1 for v in values)


def _box(b: object) -> tuple[float, ...]:
    return tuple(getattr(b, k) for k in ("x_min", "y_min", "x_max", "y_max"))


def test_clip_result_clamps_boxes_and_polygons_not_paths() -> None:
    seg = Segmentation(
        Box(-0.25, 0.5, 1.25, 1.5),
        "M -0.25 0.5 L 1.25 1.5 Z",
        ((Point(-0.25, 0.5), Point(1.25, 1.5), Point(0.5, 0.75)),),
        (0, 4),
        2,
        2,
    )
    done = Finished(
        FinishReason.EOS, boxes=[Box(-0.1, 0.2, 0.3, 1.4), Box(0, 0, 1, 1)], segmentation=seg
    )
    clip_result(done)
    assert [_box(b) for b in done.boxes] == [(0.0, 0.2, 0.3, 1.0), (0, 0, 1, 1)]
    assert done.segmentation is not None
    assert _box(done.segmentation.box) == (0.0, 0.5, 1.0, 1.0)
    assert done.segmentation.polygons == ((Point(0, 0.5), Point(1, 1), Point(0.5, 0.75)),)
    assert done.segmentation.svg_path == seg.svg_path and done.segmentation.mask_rle == (0, 4)


def test_grpc_boxes_pass_the_picture_unless_clipped(
    server: ServerThread, ref: ReferenceGenerator, picture: PreparedImage
) -> None:
    want = [_box(b) for b in ref.detect(picture, "house", max_objects=3).boxes]
    assert want and all(_outside(b) for b in want)  # as the reference returns them
    with VisionLanguageClient(server.target) as client:
        plain = client.detect(sample_image_bytes(), "house", max_objects=3)
        clipped = client.detect(sample_image_bytes(), "house", max_objects=3, clip=True)
        unset = client.detect(sample_image_bytes(), "house", max_objects=3, clip=False)
        seg = client.segment(sample_image_bytes(), "house", max_tokens=32)
        seg_clipped = client.segment(sample_image_bytes(), "house", max_tokens=32, clip=True)
    assert [_box(b) for b in plain.boxes] == want == [_box(b) for b in unset.boxes]
    assert [_box(b) for b in clipped.boxes] == [_clamp(b) for b in want]
    want_seg, _ = ref.segment(picture, "house", 32)
    assert _box(seg.box) == tuple(want_seg.box) and _outside(_box(seg.box))
    assert _box(seg_clipped.box) == _clamp(tuple(want_seg.box))
    # The polygons are clamped point by point; the path and the mask are as decoded.
    assert [[(p.x, p.y) for p in poly] for poly in seg_clipped.polygons] == [
        [_clamp((p.x, p.y)) for p in poly] for poly in seg.polygons
    ]
    assert any(_outside((p.x, p.y)) for poly in seg.polygons for p in poly)
    assert (seg_clipped.svg_path, seg_clipped.mask) == (seg.svg_path, seg.mask)


@pytest.mark.parametrize("rpc", ["Point", "Caption", "Query"])
def test_grpc_clip_elsewhere_is_refused_naming_the_field(server: ServerThread, rpc: str) -> None:
    fields = {"Point": {"object": "car"}, "Caption": {}, "Query": {"question": "q"}}[rpc]
    request = getattr(pb, f"{rpc}Request")(
        image_bytes=sample_image_bytes(), settings=pb.GenerationSettings(clip=False), **fields
    )
    with grpc.insecure_channel(server.target) as channel:
        call = getattr(pb_grpc.VisionLanguageStub(channel), rpc)
        with pytest.raises(grpc.RpcError) as info:
            answer = call(request)
            if rpc != "Point":
                list(answer)  # the streamed RPCs fail on the first read
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["vlm-field"] == "settings.clip"


def test_http_boxes_pass_the_picture_unless_clipped(
    server: ServerThread, ref: ReferenceGenerator, picture: PreparedImage
) -> None:
    url = data_url(sample_image_bytes())
    want = [_box(b) for b in ref.detect(picture, "house", max_objects=3).boxes]
    body = {"image_url": url, "object": "house", "settings": {"max_objects": 3}}
    status, plain = post_json(f"{server.http_url}/detect", body)
    assert status == 200
    assert [
        tuple(o[k] for k in ("x_min", "y_min", "x_max", "y_max")) for o in plain["objects"]
    ] == want
    body["settings"]["clip"] = True
    status, clipped = post_json(f"{server.http_url}/detect", body)
    assert status == 200
    got = [tuple(o[k] for k in ("x_min", "y_min", "x_max", "y_max")) for o in clipped["objects"]]
    assert got == [_clamp(b) for b in want]
    want_seg, _ = ref.segment(picture, "house", 32)
    seg_body = {"image_url": url, "object": "house", "settings": {"max_tokens": 32}}
    status, seg = post_json(f"{server.http_url}/segment", seg_body)
    assert status == 200 and tuple(seg["bbox"].values()) == tuple(want_seg.box)
    seg_body["settings"]["clip"] = True
    status, seg_clipped = post_json(f"{server.http_url}/segment", seg_body)
    assert status == 200 and tuple(seg_clipped["bbox"].values()) == _clamp(tuple(want_seg.box))
    assert seg_clipped["path"] == seg["path"]


@pytest.mark.parametrize(
    ("route", "clip", "words"),
    [("detect", "yes", "boolean"), ("segment", 1, "boolean"), ("point", True, "only detect")],
)
def test_http_bad_clip_is_refused_naming_the_field(
    server: ServerThread, route: str, clip: object, words: str
) -> None:
    body = {
        "image_url": data_url(sample_image_bytes()),
        "object": "car",
        "settings": {"clip": clip},
    }
    status, answer = post_json(f"{server.http_url}/{route}", body)
    assert status == 400
    assert answer["error"]["field"] == "settings.clip" and words in answer["error"]["message"]
