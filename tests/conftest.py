"""Shared fixtures: seeded tiny checkpoints, loaded models, the sample image."""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.support import cluster_command, early, spawned_server
from tests.support.cluster_command import LaunchedCluster
from tests.support.reference_memo import shared_reference
from tests.support.spawned_server import SpawnedServer
from vlm_server.models.interface import LoadedModel
from vlm_server.models.registry import load_model, preset, write_checkpoint
from vlm_server.reference import ReferenceGenerator, SamplingSettings


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow (minutes each on a CPU; skipped by default so "
        "that the suite stays within a few minutes on two cores)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--run-slow") and not os.environ.get("VLM_RUN_SLOW"):
        slow = pytest.mark.skip(reason="slow: run with --run-slow (or VLM_RUN_SLOW=1)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Commands under test install their own log handler on the root logger, bound to the
    test's captured stderr, which is closed after the test: later log lines (a server's
    thread still answering) would fail to write there."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _slow_starts_begin_with_the_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The commands some tests drive take seconds to start, waiting on processes while the
    tests before them use one core: when such a test is in the run, its command starts with
    the run, and the test takes it over (see tests.support.early)."""
    starts: dict[Hashable, Callable[[Path], early.Stoppable]] = {}
    for item in request.session.items:
        if item.path.name == "test_cluster_command.py":
            folder = tmp_path_factory.mktemp("cluster")
            starts[cluster_command.KEY] = functools.partial(LaunchedCluster, folder=folder)
        elif item.path.name == "test_service_lifecycle.py" and "engine_process" in (
            params := getattr(getattr(item, "callspec", None), "params", {})
        ):
            mode = params["engine_process"]
            starts[spawned_server.key(mode)] = functools.partial(SpawnedServer, engine_process=mode)
    if starts:
        model = request.getfixturevalue("tiny_dir")
        for key, start in starts.items():
            early.launch(key, functools.partial(start, model))
    yield
    early.stop_untaken()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def generator(tiny: LoadedModel) -> ReferenceGenerator:
    return shared_reference(tiny.model, tiny.tokenizer)


@pytest.fixture(scope="session")
def sample_image() -> PreparedImage:
    return prepare_image(sample_image_bytes())


@pytest.fixture(scope="session")
def text_model(tiny: LoadedModel, sample_image: PreparedImage) -> LoadedModel:
    """Emits eos wherever the plain model would emit one common token, so generations end
    with eos at different steps for different prompts."""
    ref = ReferenceGenerator(tiny.model, tiny.tokenizer)
    out = ref.query(
        sample_image, "what is this?", SamplingSettings(temperature=0, max_tokens=8)
    ).token_ids
    common = out[5]
    model = copy.deepcopy(tiny.model)
    eos = tiny.config.tokens.eos_id
    with torch.no_grad():
        head = model.text.lm_head
        head.weight[eos] = head.weight[common]
        head.bias[eos] = head.bias[common] + 1e-3
    return LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)


@pytest.fixture(scope="session")
def region_model(tiny: LoadedModel) -> LoadedModel:
    """At an object boundary eos and coord nearly tie, and which one wins depends on the
    hidden state: answers stop with eos after different numbers of objects, or hit the cap."""
    c = tiny.config.tokens
    model = copy.deepcopy(tiny.model)
    noise = torch.randn(
        model.text.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        head = model.text.lm_head
        head.bias[c.coord_id] = head.bias.max() + 5.0
        head.weight[c.eos_id] = head.weight[c.coord_id] + 0.1 * noise
        # Tuned on the seed-0 tiny model: some answers end at once, others hit the cap.
        head.bias[c.eos_id] = head.bias[c.coord_id] - 1.49
    return LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)


@pytest.fixture(scope="session")
def reasoning_model(tiny: LoadedModel) -> LoadedModel:
    """The coordinate token, a span opener and the answer marker take the head rows of tokens
    the seed-0 tiny model often picks (the marker exactly tied with one, so sampling decides):
    sampled reasonings ground points, open spans and reach the answer."""
    c = tiny.config.tokens
    model = copy.deepcopy(tiny.model)
    head = model.text.lm_head
    with torch.no_grad():
        for i, (tok, src, bias, scale) in enumerate(
            [
                (c.coord_id, 1020, 0.1, 0.3),
                (c.start_ground_points_id, 475, 0.0, 0.3),
                (c.end_ground_id, 720, 0.0, 0.3),
                (c.answer_id, 331, 0.0, 0.0),
            ]
        ):
            noise = torch.randn(
                head.weight.shape[1], generator=torch.Generator().manual_seed(i + 1)
            )
            head.weight[tok] = head.weight[src] + scale * noise * head.weight[src].std()
            head.bias[tok] = head.bias[src] + bias
    return LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)
