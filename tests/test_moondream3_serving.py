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
from tests.http_support import post_json
from tests.support.service_harness import ServerThread, local_config
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
    with ServerThread(config, lambda: batched_engine(config)) as running:
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
        # Moondream 3's segment path (a 960-unit box, per-token SVG text) is not the segment
        # grammar's language: refused until it is (docs/moondream3.md).
        with pytest.raises(VlmError) as err:
            client.segment(sample_image_bytes(), "dog", max_tokens=32)
        assert err.value.code is grpc.StatusCode.UNIMPLEMENTED


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
