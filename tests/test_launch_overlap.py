"""The early-launch switch (models/common/launch_overlap.py) off the GPU: it never turns on
where the chip cannot take it, and then adds nothing to a kernel's launch."""

from __future__ import annotations

import pytest

from vlm_server.models.common import launch_overlap


@pytest.fixture(autouse=True)
def _off_after():
    yield
    launch_overlap.enable(False, "cpu")


def test_the_cpu_gets_no_early_launches() -> None:
    assert launch_overlap.supported("cpu") is False
    assert launch_overlap.enable(True, "cpu") is False
    assert launch_overlap.enabled() is False
    assert launch_overlap.kernel_args() == {}


def test_triton_s_interpreter_gets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_overlap.supported("cuda:0") is False


def test_the_engine_option_reaches_the_runtime_config() -> None:
    from vlm_server.options.table import ServerConfig

    assert ServerConfig().engine_config.launch_overlap is False
    assert ServerConfig(launch_overlap=True).engine_config.launch_overlap is True
