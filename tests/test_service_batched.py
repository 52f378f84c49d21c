"""The same gRPC front door on the batched engine: engine-agnostic, reference-exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from image_pipeline import PreparedImage, sample_image_bytes
from vlm_server.client import VisionLanguageClient
from vlm_server.engine.batched_engine import BatchedEngine
from vlm_server.engine.config import EngineConfig
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.service.testing import ServerThread, local_config
from vlm_server.weights.loader import LoadedModel


@pytest.fixture(scope="module")
def client(tiny: LoadedModel) -> Iterator[VisionLanguageClient]:
    factory = lambda: BatchedEngine(tiny, EngineConfig(max_batch=8, max_queue=64))
    with ServerThread(local_config(), factory) as server, \
            VisionLanguageClient(server.target, timeout=120) as c:
        yield c


def test_text_and_regions_equal_the_reference(client: VisionLanguageClient,
                                              generator: ReferenceGenerator,
                                              sample_image: PreparedImage) -> None:
    image = client.encode_image(sample_image_bytes())
    settings = SamplingSettings(temperature=0.0, max_tokens=10)
    events = list(client.caption_stream(image, temperature=0, max_tokens=10))
    want = generator.caption(sample_image, "normal", settings)
    assert "".join(e.text for e in events[:-1]) == events[-1].text == want.text
    got = client.query(None, "what now?", temperature=0, max_tokens=10)
    assert got.text == generator.query(None, "what now?", settings).text
    points = client.point(image, "sun", max_objects=3).points
    assert [(p.x, p.y) for p in points] == [
        (p.x, p.y) for p in generator.point(sample_image, "sun", max_objects=3).points]
    boxes = client.detect(image, "house", max_objects=3).boxes
    assert [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes] == [
        (b.x_min, b.y_min, b.x_max, b.y_max)
        for b in generator.detect(sample_image, "house", max_objects=3).boxes]


def test_constraints_and_segment_come_through(client: VisionLanguageClient) -> None:
    image = client.encode_image(sample_image_bytes())
    assert client.query(image, "sunny?", choices=["yes", "no"]).text in ("yes", "no")
    assert client.query(image, "count?", regex="[0-9]{1,2}", max_tokens=8).text.isdigit()
    seg = client.segment(image, "house", max_tokens=64)
    assert seg.mask.height == 600 and seg.mask.width == 800
    assert sum(seg.mask.counts) == 600 * 800
    assert seg.svg_path.startswith("M") and seg.polygons
