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
    from vlm_server.engine.config import EngineConfig
    from vlm_server.options.table import ServerConfig

    assert ServerConfig().engine_config.launch_overlap == "idle"
    assert ServerConfig(launch_overlap="always").engine_config.launch_overlap == "always"
    with pytest.raises(ValueError, match="launch_overlap must be one of off, idle, always"):
        EngineConfig(launch_overlap="true")


def test_enabled_within_restores_the_switch() -> None:
    with launch_overlap.enabled_within("cpu") as on:
        assert on is False and launch_overlap.kernel_args() == {}
    assert launch_overlap.enabled() is False


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_cpu_runtime_takes_no_early_steps_and_tracks_prefixes_in_flight(tiny) -> None:
    """On the CPU the idle mode is off (no graphs, no early launches) and a served request
    takes no early step; the busy check drops finished batches and sees running ones."""
    import asyncio

    from image_pipeline import prepare_image, sample_image_bytes
    from vlm_server.engine.api import GenerationRequest, Task
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine
    from vlm_server.server.in_process import InProcessEngine

    async def serve() -> InProcessEngine:
        engine = InProcessEngine(
            BatchedEngine(tiny, EngineConfig(max_batch_size=2, launch_overlap="idle"))
        )
        await engine.start()
        try:
            req = GenerationRequest(Task.CAPTION, prepare_image(sample_image_bytes()), max_tokens=3)
            async for _ in await engine.submit(req):
                pass
        finally:
            await engine.close()
        return engine

    rt = asyncio.run(serve()).batched.runtime
    assert rt.launch_overlap == "off" and rt.steps.early_steps == 0
    assert not rt.steps.early_decode_graphs and not rt.steps.early_mixed_graphs
    assert not rt.prefill_busy()
    running, done = _Event(False), _Event(True)
    # (handle, in the SM partition, on the interactive lane)
    rt._prefixes_in_flight = [
        (done, False, False),
        (running, False, False),
        (_Event(True), False, True),
    ]
    assert rt.prefill_busy() and rt.prefill_contends()
    assert rt._prefixes_in_flight == [(running, False, False)]
    running.done = True
    assert not rt.prefill_busy() and rt._prefixes_in_flight == []
    # A batch in the SM partition is busy but leaves the rest of the GPU to the steps.
    partitioned = _Event(False)
    rt._prefixes_in_flight = [(partitioned, True, False), (_Event(True), False, False)]
    assert rt.prefill_busy() and not rt.prefill_contends()
    # The interactive lane's batches have the whole GPU.
    rt._prefixes_in_flight.append((running := _Event(False), False, True))
    assert rt.prefill_contends()
    assert rt.steps.prefill_contends() == rt.prefill_contends()


def test_a_batch_is_in_the_partition_on_its_lane_or_where_the_one_lane_is_it() -> None:
    """What `prefill_contends` reads per batch: two lanes (partitioned while streaming), one
    lane that is the partition (no threshold), one lane with the whole GPU (no partition)."""
    from types import SimpleNamespace

    from vlm_server.engine.device.prefill import Prefill

    def prefill(lanes: int, partition: bool) -> Prefill:
        dev = SimpleNamespace(
            prefill_stream=object(),
            partitioned_prefill_stream=object() if lanes > 1 else None,
            prefill_capture_stream=object() if partition else None,
        )
        crops = SimpleNamespace(graphs=lambda capture: None)
        p = Prefill.__new__(Prefill)
        p.dev, p.crops, p.interactive = dev, crops, False
        p.lanes = p._lanes()
        return p

    two, part_only, whole = prefill(2, True), prefill(1, True), prefill(1, False)
    assert len(two.lanes) == 2 and len(part_only.lanes) == len(whole.lanes) == 1
    assert two.on_partition(True) and not two.on_partition(False)
    assert part_only.on_partition(False) and part_only.on_partition(True)
    assert not whole.on_partition(True) and not whole.on_partition(False)
