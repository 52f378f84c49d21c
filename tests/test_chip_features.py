"""Chip-gated features on a GPU that lacks them (the capability query mocked): FP8 vision and
SM partitions (green contexts) refuse at start with one line naming their flag, and the JPEG
engines fall back to nvJPEG under ``auto`` and refuse in one line when asked for by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from image_pipeline import gpu_jpeg
from vlm_server import chip_features
from vlm_server.chip_features import Chip, ChipFeatureError, check
from vlm_server.frontend import images
from vlm_server.options.table import ServerConfig
from vlm_server.server.main import main

A100 = Chip("NVIDIA A100-SXM4-80GB", (8, 0), 12080, True)
A10 = Chip("NVIDIA A10", (8, 6), 12080, True)
L4 = Chip("NVIDIA L4", (8, 9), 12080, True)
H100 = Chip("NVIDIA H100 80GB HBM3", (9, 0), 13000, True)


def _one_line(err: ChipFeatureError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("chip", [A100, A10, None], ids=["sm_80", "sm_86", "no GPU"])
def test_fp8_vision_refuses_chips_without_fp8_units(chip: Chip | None) -> None:
    with pytest.raises(ChipFeatureError) as caught:
        check(vision_fp8=True, prefill_sms=0, chip=chip)
    text = _one_line(caught.value)
    assert text.startswith("--vision-fp8 needs FP8") and "drop the flag" in text
    assert (chip.sm in text) if chip else "no CUDA device" in text


@pytest.mark.parametrize("chip", [L4, H100], ids=["sm_89", "sm_90"])
def test_fp8_vision_is_accepted_from_sm_89(chip: Chip) -> None:
    check(vision_fp8=True, prefill_sms=0, chip=chip)


@pytest.mark.parametrize(
    ("chip", "says"),
    [
        (Chip("GTX 980", (5, 2), 12080, True), "sm_52"),
        (Chip("NVIDIA A100", (8, 0), 12080, False), "torch.cuda.green_contexts"),
        (Chip("NVIDIA A100", (8, 0), 12020, True), "CUDA 12.2"),
        (None, "no CUDA device"),
    ],
)
def test_sm_partitions_refuse_without_green_contexts(chip: Chip | None, says: str) -> None:
    with pytest.raises(ChipFeatureError) as caught:
        check(vision_fp8=False, prefill_sms=16, chip=chip)
    text = _one_line(caught.value)
    assert text.startswith("--prefill-sms needs CUDA green contexts") and says in text


def test_sm_partitions_are_accepted_with_green_contexts() -> None:
    check(vision_fp8=False, prefill_sms=16, chip=A100)
    check(vision_fp8=False, prefill_sms=0, chip=None)  # not asked for: nothing to check


@pytest.mark.parametrize(
    ("chip", "sms", "says"),
    [
        (Chip("NVIDIA H100 80GB HBM3", (9, 0), 13000, True, 132), 96, "96 of 132 SMs"),
        (Chip("NVIDIA H200", (9, 0), 13000, True, 132), 96, "96 of 132 SMs"),
        (Chip("NVIDIA A100", (8, 0), 12080, True, 108), 72, "72 of 108 SMs"),
        (Chip("NVIDIA L4", (8, 9), 12080, True, 58), 0, "58 SMs are under 64"),
        (Chip("NVIDIA A100", (8, 0), 12080, False, 108), 0, "torch.cuda.green_contexts"),
        (Chip("NVIDIA A100", (8, 0), 12020, True, 108), 0, "CUDA 12.2"),
        (Chip("GTX 980", (5, 2), 12080, True, 16), 0, "sm_52"),
        (None, 0, "no CUDA device"),
    ],
)
def test_auto_partition_takes_the_measured_share_or_falls_back(
    chip: Chip | None, sms: int, says: str
) -> None:
    got, why = chip_features.auto_prefill_sms(chip)
    assert got == sms and says in why and "\n" not in why
    assert got % chip_features.SM_GRANULE == 0
    if got:
        assert got < chip.sms  # type: ignore[union-attr]  (the decode steps keep the rest)
    check(vision_fp8=False, prefill_sms=got, chip=chip)  # what auto picks passes the check
    # auto is never refused at start: it falls back instead.
    chip_features.check_config(ServerConfig(prefill_sms="auto"), probe=lambda: chip)


@pytest.fixture
def an_a100(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch reports one A100 (this machine need not have a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    props = type("Props", (), {"multi_processor_count": 108})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(chip_features, "_driver_version", lambda: 12080)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers  # main() installs its own log handler
    root.setLevel(level)


@pytest.mark.parametrize(
    ("flags", "flag"),
    [(["--vision-fp8", "true"], "--vision-fp8")],
)
def test_the_server_refuses_at_start_in_one_line_naming_the_flag(
    an_a100: None, capsys: pytest.CaptureFixture[str], flags: list[str], flag: str
) -> None:
    assert main(["--device", "cuda", "--port", "0", *flags]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "level=error" in err[0] and flag in err[0] and "sm_80" in err[0]


def test_green_contexts_missing_from_torch_refuse_at_start(
    an_a100: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(chip_features, "_green_contexts_in_torch", lambda: False)
    assert main(["--device", "cuda", "--port", "0", "--prefill-sms", "16"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--prefill-sms" in err[0]


def _no_engines(device: torch.device) -> gpu_jpeg.GpuDecoder:
    raise RuntimeError("no hardware JPEG decoder on this device (nvImageCodec probe failed)")


def test_auto_falls_back_to_nvjpeg_where_the_chip_has_no_jpeg_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu_jpeg, "nvimgcodec_decoder", _no_engines)
    on_sms = lambda data, device: torch.zeros(3, 2, 2, dtype=torch.uint8)
    monkeypatch.setattr(gpu_jpeg, "torchvision_decoder", lambda device: on_sms)
    assert gpu_jpeg.gpu_decoder(torch.device("cuda"), "auto") is on_sms


def test_the_jpeg_engines_asked_for_by_name_refuse_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu_jpeg, "nvimgcodec_decoder", _no_engines)
    monkeypatch.setattr(images, "gpu_decoder", gpu_jpeg.gpu_decoder)
    config = ServerConfig(
        device="cuda", image_gpu_decode_min_pixels=1_000_000, image_gpu_decoder="nvimgcodec"
    )
    with pytest.raises(ValueError) as caught:
        images.image_preparer(config)
    text = str(caught.value)
    assert "\n" not in text and "--image-gpu-decoder nvimgcodec" in text
    assert "no hardware JPEG decoder" in text
