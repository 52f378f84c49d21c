"""Adapters on the fake device: the production runtime with each row's adapter slot uploaded
beside the block table keeps the pipeline invariants under random interleavings, and answers
as the blocking run does (which differs from the base model's)."""

from __future__ import annotations

import pytest

from image_pipeline import PreparedImage
from tests.test_engine_fake_device import SEEDS, Run, _drive, images  # noqa: F401  (fixture)
from vlm_server.models.interface import LoadedModel


@pytest.fixture(scope="module")
def blocking(region_model: LoadedModel, images: list[PreparedImage]) -> Run:  # noqa: F811
    run = _drive(region_model, images, 1, 0, adapters=2)
    assert run.answers() != _drive(region_model, images, 1, 0).answers()  # they matter
    return run


@pytest.mark.parametrize("seed", SEEDS[1:3])
def test_adapter_rows_keep_the_invariants_and_the_answers(
    region_model: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    seed: int,
    blocking: Run,
) -> None:
    run = _drive(region_model, images, 2, seed, adapters=2)
    assert run.answers() == blocking.answers()
    assert run.device.kernel_streams == ["compute"]
    committed = [step for what, step in run.watch.trace if what == "commit"]
    assert run.device.host_waits == [f"slot{step.slot}.d2h_done" for step in committed]
    s = run.sched
    assert not s.zombies and not s.running and not s.waiting
