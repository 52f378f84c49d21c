"""``--chip-profile``: a GPU answers as another chip of the table would, for every launch
choice and feature gate (CPU: what the profile says; the GPU suite runs under profiles)."""

from __future__ import annotations

import pytest
import torch

from vlm_server import chip_features
from vlm_server.chips import KIB, by_name, profile
from vlm_server.options.command_line import load_config
from vlm_server.options.table import ServerConfig

GIB = 1 << 30


@pytest.fixture
def no_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(chip_features.PROFILE_ENV, raising=False)


@pytest.mark.parametrize(
    ("name", "chip"),
    [("rtx3090", "RTX 3090"), ("RTX 4090", "RTX 4090"), ("a100", "A100 80GB"), ("h100", "H100")],
)
def test_profiles_are_named_as_people_type_them(name: str, chip: str) -> None:
    assert profile(name) is by_name(chip)


def test_an_unknown_profile_names_the_field_and_the_chips() -> None:
    with pytest.raises(ValueError, match=r"chip_profile: unknown chip 'rtx9999'; known: .*rtx3090"):
        profile("rtx9999")
    with pytest.raises(SystemExit):
        load_config(["--chip-profile", "rtx9999"], environ={})


def test_the_profile_is_what_launches_and_gates_read(
    monkeypatch: pytest.MonkeyPatch, no_profile: None
) -> None:
    chip_features.use_chip_profile("rtx3090")
    assert chip_features.capability("cuda") == (8, 6)
    spec = chip_features.device_spec(0)
    assert (spec.name, spec.sms, spec.limits.shared_per_block) == ("RTX 3090", 82, 99 * KIB)
    assert not spec.fp8
    chip_features.use_chip_profile("rtx4090")
    assert chip_features.capability("cuda") == (8, 9) and chip_features.device_spec(0).fp8
    chip_features.use_chip_profile(None)
    assert chip_features.chip_profile() is None


def test_the_environment_names_the_profile_of_an_engine_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(chip_features.PROFILE_ENV, "a100")
    assert chip_features.capability(torch.device("cuda:0")) == (8, 0)
    assert chip_features.device_spec(0).limits.shared_per_block == 163 * KIB


def test_a_profile_caps_memory_at_the_chips_unless_a_cap_is_given(no_profile: None) -> None:
    plain = ServerConfig()
    assert plain.memory_cap_bytes == 0 and plain.engine_config.gpu_memory_bytes is None
    as_3090 = ServerConfig(chip_profile="rtx3090")
    assert as_3090.memory_cap_bytes == int(23.57 * GIB)
    assert as_3090.engine_config.gpu_memory_bytes == int(23.57 * GIB)
    capped = ServerConfig(chip_profile="rtx3090", gpu_memory_bytes=8 * GIB)
    assert capped.memory_cap_bytes == 8 * GIB


def test_the_fp8_tower_is_refused_under_a_profile_without_fp8(
    monkeypatch: pytest.MonkeyPatch, no_profile: None
) -> None:
    """check_config takes the config's profile on before it asks the chip (a probe stands in
    for the device, as the profile's capability does for current_chip on a GPU)."""
    config = ServerConfig(chip_profile="a100", vision_fp8="on", device="cuda")
    probe = lambda: chip_features.Chip("A100 80GB", chip_features.capability("cuda"))
    with pytest.raises(chip_features.ChipFeatureError, match="vision-fp8"):
        chip_features.check_config(config, probe)
    assert chip_features.chip_profile() is profile("a100")
    chip_features.use_chip_profile(None)
