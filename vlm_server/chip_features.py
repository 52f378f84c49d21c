"""Features that need a newer chip than some the server may run on, checked once at start.

Each either refuses with one line that names its flag, the chip and what it needs, or falls
back and says so, instead of failing later (a kernel that does not build, a driver error at the
first request, a decode path that silently does nothing):

* ``--vision-fp8``: FP8 matrix units, compute capability 8.9 or newer (L4, L40, H100, B200,
  RTX 40 and later). Refused below.
* ``--prefill-sms``: CUDA green contexts: compute capability 6.0 or newer, a torch that has
  ``torch.cuda.green_contexts`` and a driver of CUDA 12.4 or newer. A count asked for is
  refused without them; ``auto`` (the default) then runs unpartitioned (`auto_prefill_sms`).
* ``--image-gpu-decoder``: the chip's JPEG decode engines through nvImageCodec (A100, A30,
  H100, H200, B200 have them; most others do not). ``auto`` falls back to nvJPEG on the SMs;
  ``nvimgcodec`` asked for by name is refused where it cannot work (image_pipeline.gpu_jpeg
  probes it; the server says so at start in one line naming the flags).

`Chip` is read from torch (`current_chip`); tests give one of their own. What a chip can do
(shared memory, registers, FP8 units, the published table) is `vlm_server.chips`'s; the
device's own report of it is `device_spec`.

A chip profile (``--chip-profile NAME``, or ``VLM_CHIP_PROFILE`` in the environment, which the
server sets for its engine process) makes a GPU answer as another chip would: its compute
capability, SM count and limits in `device_spec`, `current_chip`, `capability` and
`fp8_supported`, so every launch choice and feature gate reads the profile's; its memory is
the engine's cap (options/table.py). The kernels then run the smaller chip's paths on this
one; their speed is not that chip's.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vlm_server.chips import FP8_CAPABILITY, ChipSpec, from_device, profile

PROFILE_ENV = "VLM_CHIP_PROFILE"

GREEN_CONTEXT_CAPABILITY = (6, 0)
GREEN_CONTEXT_DRIVER = 12040  # CUDA 12.4, as cudaDriverGetVersion writes it


class ChipFeatureError(ValueError):
    """A flag asks for what this chip (or driver, or torch) lacks; the message is one line."""


@dataclass(frozen=True)
class Chip:
    name: str
    capability: tuple[int, int]
    driver: int = 0  # cudaDriverGetVersion (12040 = 12.4); 0: unknown
    green_contexts: bool = False  # torch.cuda.green_contexts is there
    sms: int = 0  # streaming multiprocessors; 0: unknown

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def chip_profile() -> ChipSpec | None:
    """The chip the process runs as (`PROFILE_ENV`), or None: the device's own."""
    name = os.environ.get(PROFILE_ENV)
    return profile(name) if name else None


def device_spec(index: int) -> ChipSpec:
    """CUDA device ``index`` as it reports itself (name, capability, SMs, memory, shared memory
    a block may opt in to), the chip table filling the rest (`vlm_server.chips`); the chip
    profile's instead when one is set."""
    return chip_profile() or _reported_spec(index)


def capability(device: torch.device | str) -> tuple[int, int]:
    """The compute capability of CUDA ``device`` (the chip profile's when one is set)."""
    chosen = chip_profile()
    if chosen is not None:
        return chosen.capability
    return tuple(torch.cuda.get_device_capability(torch.device(device)))  # type: ignore[return-value]


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 matrix units (compute capability 8.9 or newer)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return capability(device) >= FP8_CAPABILITY


@functools.cache
def _reported_spec(index: int) -> ChipSpec:
    props = torch.cuda.get_device_properties(index)
    return from_device(
        props.name,
        (props.major, props.minor),
        props.multi_processor_count,
        props.total_memory,
        props.shared_memory_per_block_optin,
    )


def _green_contexts_in_torch() -> bool:
    try:
        module = importlib.import_module("torch.cuda.green_contexts")
    except ImportError:
        return False
    return hasattr(module, "GreenContext")


def _driver_version() -> int:
    try:
        return int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
    except Exception:  # no CUDA, or a torch without it: unknown
        return 0


def current_chip(device: str | None) -> Chip | None:
    """The CUDA chip ``device`` (``cuda``, ``cuda:1``; None: the default) names; None on the
    CPU or without CUDA."""
    if device is not None and not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return None
    index = torch.device(device or "cuda").index or 0
    chosen = chip_profile()
    if chosen is not None:
        driver, green = _driver_version(), _green_contexts_in_torch()
        return Chip(chosen.name, chosen.capability, driver, green, chosen.sms)
    return Chip(
        torch.cuda.get_device_name(index),
        tuple(torch.cuda.get_device_capability(index)),  # type: ignore[arg-type]
        _driver_version(),
        _green_contexts_in_torch(),
        torch.cuda.get_device_properties(index).multi_processor_count,
    )


def _green_context_lack(chip: Chip | None, where: str) -> str | None:
    """What keeps ``chip`` from green contexts, or None where they work."""
    if chip is None or chip.capability < GREEN_CONTEXT_CAPABILITY:
        return where
    if not chip.green_contexts:
        return "this torch has no torch.cuda.green_contexts (torch 2.8 or newer has)"
    if 0 < chip.driver < GREEN_CONTEXT_DRIVER:
        return f"the driver is CUDA {chip.driver // 1000}.{chip.driver % 1000 // 10}"
    return None


# ``--prefill-sms auto``: the image path's share of the SMs while captions stream, measured
# on an H100 (96 of 132; docs/performance.md): new images' step-gap ratio 3.40 -> 2.02-2.18
# against fewer SMs (64: 2.20, 48: 2.09, 32: 2.84, where the image path falls behind 20
# pictures a second). Chips with fewer SMs than AUTO_MIN_SMS run unpartitioned: their image
# path has no SMs to spare (not measured).
AUTO_PREFILL_SHARE = 96 / 132
AUTO_MIN_SMS = 64
SM_GRANULE = 8  # green contexts split SMs in groups (8 on Hopper); the driver rounds to them


def auto_prefill_sms(chip: Chip | None) -> tuple[int, str]:
    """The SMs ``--prefill-sms auto`` gives the image path on ``chip`` (0: no partition), and
    why, in words for the start-up log."""
    where = "no CUDA device" if chip is None else f"{chip.name} ({chip.sm})"
    lack = _green_context_lack(chip, where)
    if lack is not None:
        return 0, f"no partition: green contexts are missing ({lack})"
    assert chip is not None
    if chip.sms < AUTO_MIN_SMS:
        return 0, f"no partition: {chip.sms} SMs are under {AUTO_MIN_SMS}"
    sms = int(chip.sms * AUTO_PREFILL_SHARE) // SM_GRANULE * SM_GRANULE
    return sms, f"{sms} of {chip.sms} SMs for new images while requests stream"


def check(
    vision_fp8: bool,
    prefill_sms: int,
    chip: Chip | None,
    kv_dtype: str = "auto",
) -> None:
    """Raise `ChipFeatureError` (one line, naming the flag) for a feature ``chip`` lacks;
    ``chip`` None (no CUDA device) refuses every CUDA-only feature asked for (FP8 keys and
    values are not one: the CPU path converts them in PyTorch)."""
    where = (
        "this machine has no CUDA device"
        if chip is None
        else f"this GPU is {chip.name} ({chip.sm})"
    )
    if vision_fp8 and (chip is None or chip.capability < FP8_CAPABILITY):
        raise ChipFeatureError(
            "--vision-fp8 needs FP8 matrix units (compute capability 8.9 or newer: L4, L40, "
            f"H100, B200 and later); {where}: drop the flag"
        )
    if kv_dtype == "fp8" and chip is not None and chip.capability < FP8_CAPABILITY:
        raise ChipFeatureError(
            "--kv-dtype fp8 needs FP8 conversions (compute capability 8.9 or newer: L4, L40, "
            f"H100, B200 and later); {where}: use --kv-dtype int8 (the same bytes)"
        )
    if prefill_sms > 0:
        lack = _green_context_lack(chip, where)
        if lack is None:
            return
        raise ChipFeatureError(
            "--prefill-sms needs CUDA green contexts (compute capability 6.0 or newer, a "
            f"driver of CUDA 12.4 or newer); {lack}: set --prefill-sms 0 or auto"
        )


Probe = Callable[[], Chip | None]


class ChipFlags(Protocol):
    """The server-config fields a chip must support (the option table's `ServerConfig`)."""

    @property
    def device(self) -> str | None: ...

    @property
    def vision_fp8(self) -> str: ...

    @property
    def prefill_sms(self) -> str: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def chip_profile(self) -> str | None: ...


def use_chip_profile(name: str | None) -> None:
    """Run this process, and the processes it starts, as chip ``name`` (None: as itself)."""
    if name is None:
        os.environ.pop(PROFILE_ENV, None)
    else:
        profile(name)  # raises naming the chips known
        os.environ[PROFILE_ENV] = name


def check_config(config: ChipFlags, probe: Probe | None = None) -> None:
    """`check` for a server config (``prefill_sms`` ``auto`` asks for nothing, it falls
    back), as the config's chip profile where it names one (which the process takes on)."""
    if config.chip_profile is not None:
        use_chip_profile(config.chip_profile)
    prefill_sms = 0 if config.prefill_sms == "auto" else int(config.prefill_sms)
    vision_fp8 = config.vision_fp8 == "on"  # auto asks for nothing: it is off where it can't run
    if not vision_fp8 and prefill_sms <= 0 and config.kv_dtype != "fp8":
        return  # nothing to ask the device
    chip = probe() if probe is not None else current_chip(config.device)
    check(vision_fp8, prefill_sms, chip, config.kv_dtype)
