"""Shared fixtures: seeded tiny checkpoints, loaded models, the sample image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from vlm_server.config import preset
from vlm_server.reference import ReferenceGenerator
from vlm_server.weights.loader import LoadedModel, load_model
from vlm_server.weights.writer import write_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def generator(tiny: LoadedModel) -> ReferenceGenerator:
    return ReferenceGenerator(tiny.model, tiny.tokenizer)


@pytest.fixture(scope="session")
def sample_image() -> PreparedImage:
    return prepare_image(sample_image_bytes())
