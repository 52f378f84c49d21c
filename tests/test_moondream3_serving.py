"""Moondream 3 served end to end: the tiny expert model, written in the md3 layout (FP8
experts), loaded by the service's own engine factory from its config.json and answering over
gRPC and HTTP exactly as the reference generation does on the same model."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from image_pipeline import prepare_image, sample_image_bytes
from tests.http_support import events, post, post_json
from tests.support.service_harness import ServerThread, in_process, local_config
from tests.test_moondream3_segment import whole_chunks
from vlm_server.client import VisionLanguageClient
from vlm_server.client.types import VlmError
from vlm_server.models import registry
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.engines import batched_engine

GREEDY = SamplingSettings(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def md3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("md3")
    return registry.write_checkpoint(registry.preset("md3-tiny"), out, layout="md3", progress=False)


@pytest.fixture(scope="module")
def md3(md3_dir: Path) -> LoadedModel:
    return registry.load_model(md3_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def md3_server(md3_dir: Path) -> Iterator[ServerThread]:
    """What ``vlm serve --model <md3 checkpoint>`` runs."""
    config = local_config(model=str(md3_dir), device="cpu", dtype="fp32", http_port=-1)
    with ServerThread(config, in_process(lambda: batched_engine(config))) as running:
        yield running


def test_the_registry_finds_the_moondream3_family_by_preset_and_checkpoint(
    md3: LoadedModel,
) -> None:
    assert {"moondream3-preview", "moondream3.1", "md3-tiny"} <= set(registry.preset_names())
    assert registry.family_for_preset("moondream3.1").name == "moondream3"
    assert type(md3.model).__name__ == "Moondream3Model"


def test_moondream3_serves_every_task_over_grpc_as_the_reference_answers(
    md3: LoadedModel, md3_server: ServerThread
) -> None:
    ref = ReferenceGenerator(md3.model, md3.tokenizer)
    image = prepare_image(sample_image_bytes())
    with VisionLanguageClient(md3_server.target, timeout=60) as client:
        greedy = {"temperature": 0.0, "max_tokens": 8}
        for length in ("short", "normal", "long"):
            got = client.caption(sample_image_bytes(), length, **greedy)
            assert got.text == ref.caption(image, length, GREEDY).text
        got = client.query(sample_image_bytes(), "what is here?", **greedy)
        assert got.text == ref.query(image, "what is here?", GREEDY).text
        events = list(client.query_stream(None, "tell me", **greedy))
        assert "".join(e.text for e in events[:-1]) == ref.query(None, "tell me", GREEDY).text
        points = client.point(sample_image_bytes(), "dog", max_objects=3)
        want = ref.point(image, "dog", max_objects=3)
        assert want.points
        assert [(p.x, p.y) for p in points.points] == [(p.x, p.y) for p in want.points]
        boxes = client.detect(sample_image_bytes(), "dog", max_objects=3)
        want = ref.detect(image, "dog", max_objects=3)
        assert want.boxes
        assert [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes.boxes] == [
            (b.x_min, b.y_min, b.x_max, b.y_max) for b in want.boxes
        ]
        got = client.segment(sample_image_bytes(), "dog", max_tokens=32)
        want, reason = ref.segment(image, "dog", 32)
        assert (got.box.x_min, got.box.y_min, got.box.x_max, got.box.y_max) == want.box
        assert (got.svg_path, got.finish_reason) == (want.path, reason)
        assert got.mask.counts == list(want.mask_counts)
        assert [[(p.x, p.y) for p in poly] for poly in got.polygons] == want.polygons
        assert got.metrics.output_tokens > 3
        with pytest.raises(VlmError) as err:  # no complete path fits two tokens
            client.segment(sample_image_bytes(), "dog", max_tokens=2)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_moondream3_serves_the_http_api(md3: LoadedModel, md3_server: ServerThread) -> None:
    ref = ReferenceGenerator(md3.model, md3.tokenizer)
    image = prepare_image(sample_image_bytes())
    url = "data:image/jpeg;base64," + base64.b64encode(sample_image_bytes()).decode()
    settings = {"temperature": 0, "max_tokens": 8}
    status, body = post_json(
        f"{md3_server.http_url}/query",
        {"image_url": url, "question": "what is here?", "settings": settings},
    )
    assert status == 200, body
    assert body["answer"] == ref.query(image, "what is here?", GREEDY).text
    status, body = post_json(
        f"{md3_server.http_url}/point",
        {"image_url": url, "object": "dog", "settings": {"max_objects": 3}},
    )
    assert status == 200, body
    want = ref.point(image, "dog", max_objects=3)
    assert [(p["x"], p["y"]) for p in body["points"]] == [(p.x, p.y) for p in want.points]


def test_moondream3_segments_over_http_as_moondreams_api_answers(
    md3: LoadedModel, md3_server: ServerThread
) -> None:
    """The box-relative path and the box, whole or streamed as it decodes: the box when the
    path begins, then its commands, then the final event; spatial references as for point."""
    ref = ReferenceGenerator(md3.model, md3.tokenizer)
    image = prepare_image(sample_image_bytes())
    url = "data:image/jpeg;base64," + base64.b64encode(sample_image_bytes()).decode()
    boxes = []
    for spatial in ([], [[0.5, 0.5, 0.9, 0.95]]):
        want, reason = ref.segment(image, "dog", 40, tuple(tuple(r) for r in spatial))
        boxes.append(want.box)
        bbox = dict(zip(("x_min", "y_min", "x_max", "y_max"), want.box, strict=True))
        body = {"image_url": url, "object": "dog", "settings": {"max_tokens": 40}}
        if spatial:
            body["spatial_refs"] = spatial
        status, answer = post_json(f"{md3_server.http_url}/segment", body)
        assert status == 200, answer
        assert (answer["path"], answer["bbox"]) == (want.box_path, bbox)
        assert answer["finish_reason"] == ("stop" if reason == "eos" else reason)
        status, _, raw = post(f"{md3_server.http_url}/segment", {**body, "stream": True})
        assert status == 200
        sent = events(raw)
        assert sent[0] == {"type": "bbox", "bbox": bbox, "request_id": sent[-1]["request_id"]}
        deltas = [e["chunk"] for e in sent[1:-1]]
        assert all(e["type"] == "path_delta" and not e["completed"] for e in sent[1:-1])
        assert "".join(deltas) == want.box_path and len(deltas) > 1
        assert whole_chunks(deltas, want.chunks)
        final = sent[-1]
        assert (final["type"], final["path"], final["bbox"], final["completed"]) == (
            "final",
            want.box_path,
            bbox,
            True,
        )
    assert boxes[0] != boxes[1]  # the reference counts: the answers tell it apart
