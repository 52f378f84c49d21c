"""The built-in model, a seeded random checkpoint, reads like text: its answers are words of
its vocabulary (no U+FFFD, no control characters), its captions end at lengths shaped by
``--length`` (short < normal < long, and none runs to the 768-token cap), and every task still
runs through it (boxes, points, an outline)."""

from __future__ import annotations

import statistics
import string
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.support.jpegs import encode, photo
from vlm_server.default_model import default_model_dir
from vlm_server.models.moondream2.readable import WORDS
from vlm_server.models.registry import load_model
from vlm_server.reference import ReferenceGenerator, SamplingSettings


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceGenerator]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        directory: Path = default_model_dir()
    loaded = load_model(directory, dtype=torch.float32, progress=False)
    yield ReferenceGenerator(loaded.model, loaded.tokenizer)


@pytest.fixture(scope="module")
def pictures() -> list[PreparedImage]:
    return [prepare_image(sample_image_bytes()), prepare_image(encode(photo(320, 240), "JPEG"))]


def _readable(text: str) -> None:
    assert "\ufffd" not in text and all(c in string.printable for c in text), repr(text)
    assert set(text.split()) <= set(WORDS), repr(text)


def test_captions_are_words_and_their_lengths_follow_the_length_asked_for(
    model: ReferenceGenerator, pictures: list[PreparedImage]
) -> None:
    lengths: dict[str, list[int]] = {}
    for length in ("short", "normal", "long"):
        runs = [
            model.caption(picture, length, SamplingSettings(seed=seed))
            for picture in pictures
            for seed in range(2)
        ]
        for run in runs:
            _readable(run.text)
            assert run.finish_reason == "eos", f"{length} ran to the cap"
        lengths[length] = [len(run.token_ids) for run in runs]
    short, normal, long = (statistics.median(lengths[k]) for k in ("short", "normal", "long"))
    assert 5 <= short < normal < long <= 300, lengths
    assert short <= 40 and long >= 2 * short, lengths


def test_answers_are_words_and_end(
    model: ReferenceGenerator, pictures: list[PreparedImage]
) -> None:
    for picture in (pictures[0], None):
        for seed in range(1):
            run = model.query(picture, "what is in the picture?", SamplingSettings(seed=seed))
            _readable(run.text)
            assert run.finish_reason == "eos" and len(run.token_ids) < 200


def test_every_task_still_runs(model: ReferenceGenerator, pictures: list[PreparedImage]) -> None:
    boxes = [len(model.detect(p, "dog").boxes) for p in pictures]
    points = [len(model.point(p, "dog").points) for p in pictures]
    assert any(boxes) and any(points)
    outline, _ = model.segment(pictures[0], "dog", max_tokens=40)
    assert outline.path.startswith("M") and outline.path.endswith("Z")
    constrained = model.query(pictures[0], "which?", choices=("yes", "no"))
    assert constrained.text in ("yes", "no")
