"""The prefill stream in an SM partition (``prefill_sms``, a CUDA green context)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from image_pipeline import PreparedImage
from tests.test_engine import (  # noqa: F401  (fixtures)
    _finish_all,
    _reference_text,
    _text_requests,
    images,
)
from vlm_server.engine.config import PREFILL_SMS_AUTO, EngineConfig
from vlm_server.engine.device.streams import (
    TorchDevice,
    partitioned_streams,
    resolved_prefill_sms,
)
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig
from vlm_server.reference import ReferenceGenerator
from vlm_server.server.in_process import InProcessEngine


def test_prefill_sms_is_a_flag_and_is_checked() -> None:
    default = load_config([], environ={})
    assert default.prefill_sms == "auto" and default.prefill_sms_when_streaming == 16
    assert default.engine_config.prefill_sms == PREFILL_SMS_AUTO
    assert load_config(["--prefill-sms", "96"]).engine_config.prefill_sms == 96
    assert load_config(["--prefill-sms", "0"]).engine_config.prefill_sms == 0
    assert load_config([], environ={"VLM_PREFILL_SMS": "64"}).engine_config.prefill_sms == 64
    assert load_config(["--prefill-sms", "AUTO"]).prefill_sms == "auto"
    for bad in ("-1", "most", "9.5"):
        with pytest.raises(SystemExit):
            load_config(["--prefill-sms", bad], environ={})
    with pytest.raises(ValueError, match="prefill_sms must be auto or a count"):
        ServerConfig(prefill_sms="half")
    with pytest.raises(ValueError, match="prefill_sms"):
        EngineConfig(prefill_sms=-8)
    # The library engine asks for no partition; the threshold is read only with one.
    assert EngineConfig().prefill_sms == 0 and EngineConfig().prefill_sms_when_streaming == 16
    config = load_config(["--prefill-sms", "96", "--prefill-sms-when-streaming", "0"])
    assert config.prefill_sms_when_streaming == 0
    with pytest.raises(ValueError, match="prefill_sms_when_streaming must be >= 0"):
        EngineConfig(prefill_sms=96, prefill_sms_when_streaming=-1)


def test_auto_is_no_partition_off_cuda(tiny: LoadedModel) -> None:
    assert resolved_prefill_sms(PREFILL_SMS_AUTO, torch.device("cpu")) == 0
    assert resolved_prefill_sms(0, torch.device("cpu")) == 0
    loaded = LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, tiny.config, tiny.source)
    engine = InProcessEngine(
        BatchedEngine(loaded, EngineConfig(prefill_sms=PREFILL_SMS_AUTO, kv_budget_bytes=8 << 20))
    )
    try:
        assert engine.batched.runtime.prefill_sms == 0
    finally:
        asyncio.run(engine.close())


def test_a_partition_off_cuda_is_refused(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="prefill_sms needs a CUDA device"):
        TorchDevice(torch.device("cpu"), prefill_sms=8)
    loaded = LoadedModel(copy.deepcopy(tiny.model), tiny.tokenizer, tiny.config, tiny.source)
    with pytest.raises(ValueError, match="prefill_sms"):
        BatchedEngine(loaded, EngineConfig(prefill_sms=8, kv_budget_bytes=8 << 20))
    no_partition = TorchDevice(torch.device("cpu"))
    assert no_partition.prefill_stream is None and no_partition.prefill_capture_stream is None


def test_one_partition_per_device_and_size_lives_as_long_as_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines share a partition; its context is never freed (a destroyed green context takes
    its streams with it, and torch aborts the process when the destroy fails)."""
    import sys
    import types

    from vlm_server.engine.device import streams

    made: list[object] = []

    class FakeContext:
        @staticmethod
        def create(num_sms: int, device_id: int) -> FakeContext:
            ctx = FakeContext()
            made.append((num_sms, device_id))
            return ctx

        def Stream(self) -> object:
            return object()

    module = types.ModuleType("torch.cuda.green_contexts")
    module.GreenContext = FakeContext  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.cuda.green_contexts", module)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda _: types.SimpleNamespace(multi_processor_count=132),
    )
    monkeypatch.setattr(streams, "_PARTITIONS", {})
    dev = torch.device("cuda", 0)
    ctx, (a, b) = streams.partitioned_streams(dev, 96)
    assert a is not b and made == [(96, 0)]
    again, (a2, b2) = streams.partitioned_streams(dev, 96)
    assert again is ctx and (a2, b2) == (a, b) and made == [(96, 0)]
    refs = sys.getrefcount(ctx)
    streams._PARTITIONS.clear()
    del again
    assert sys.getrefcount(ctx) == refs - 2  # the cache's and ours went; the leaked one stays
    assert sys.getrefcount(ctx) > 2  # the local name, getrefcount's argument, and the leak
    other, _ = streams.partitioned_streams(dev, 64)
    assert other is not ctx and made == [(96, 0), (64, 0)]
    with pytest.raises(ValueError, match=r"prefill_sms must be in 1\.\.131"):
        streams.partitioned_streams(dev, 132)


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_partition_sizes_out_of_range_are_refused() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for bad in (0, sms, sms + 8):
        with pytest.raises(ValueError, match="prefill_sms must be in"):
            partitioned_streams(device, bad)


@pytest.mark.gpu
@pytest.mark.parametrize(("depth", "when_streaming"), [(1, 0), (2, 0), (2, 4)])
def test_cuda_engine_with_a_prefill_partition_equals_the_reference(
    text_model: LoadedModel,
    images: list[PreparedImage],  # noqa: F811
    depth: int,
    when_streaming: int,
) -> None:
    """The same kernels on fewer SMs: the answers are the reference's, and the image and prefix
    graphs were captured on the partitioned stream (with ``when_streaming``, on both lanes)."""
    model = copy.deepcopy(text_model.model).cuda()
    loaded = LoadedModel(model, text_model.tokenizer, text_model.config, text_model.source)
    reqs = _text_requests(images)

    def check(engine: InProcessEngine) -> None:
        rt = engine.batched.runtime
        assert isinstance(rt.dev, TorchDevice) and rt.dev.prefill_capture_stream is not None
        assert len(rt.prefill.lanes) == (2 if when_streaming else 1)
        assert all(lane.image_graphs and lane.prefix_graphs for lane in rt.prefill.lanes)

    finished = _finish_all(
        loaded,
        reqs,
        depth,
        check,
        max_batch_size=4,
        prefill_sms=32,
        prefill_sms_when_streaming=when_streaming,
    )
    ref = ReferenceGenerator(model, text_model.tokenizer)
    for req, fin in zip(reqs, finished, strict=True):
        assert fin.text == _reference_text(ref, req), req.request_id
