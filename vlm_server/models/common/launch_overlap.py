"""Programmatic dependent launch for the decode step's Triton kernels (Hopper and newer).

In a CUDA graph a kernel normally starts only after the one before it has finished and its
writes are visible: a decode step is ~150 short kernels, and each boundary leaves the GPU
idle for about a microsecond and a half. With programmatic dependent launch a kernel is
launched while its predecessor still runs; its programs then wait (``griddepcontrol.wait``)
for the predecessor to finish before they touch memory, so the launch and the programs' start
hide under the predecessor's tail.

A kernel takes part by calling `gdc_wait` and then `gdc_launch_dependents` first thing,
under its ``PDL`` constant, and by being launched with `kernel_args()`. Waiting before any
load or store keeps every hazard as it was: the kernel reads nothing its predecessor writes,
and overwrites nothing its predecessor reads, before that predecessor is done; letting the
successor launch only after the wait keeps at most one kernel waiting behind the running one.
A kernel launched without the attribute (a PyTorch op, an adapter kernel) waits for its
predecessor as before.

The switch is process-wide and read at each launch: `enable` it before any graph captures the
kernels, or capture a second set of graphs `enabled_within` (the engine does either at start
from ``--launch-overlap``). The cost: a kernel's early programs hold their SMs while they wait,
so work on another stream (a new image's tower and prefix beside the decode steps) gets fewer
SMs. On an H100, with every step launched early, the decode period fell 3.5% at one stream
while new images' prefill under 20 arrivals a second took 75 ms instead of 48: by default
("idle") only the steps launched while no prefill is in flight take the early-launch graphs,
and mixed steps beside a prefill in the SM partition (``--prefill-sms``), where they took the
streams' step-gap ratio from 2.04 to 1.76 and left new images' first tokens their time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from vlm_server.chip_features import capability

# Compute capability from which griddepcontrol exists (PTX ISA: sm_90).
CAPABILITY = (9, 0)

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without grid dependency control
    gdc_launch_dependents = gdc_wait = None

_enabled = False


def supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` can launch early: a CUDA chip of compute capability 9.0
    or newer, a Triton with grid dependency control, and not Triton's CPU interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or gdc_wait is None or not torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return capability(device) >= CAPABILITY


def enable(on: bool, device: torch.device | str) -> bool:
    """Turn early launches on (where `supported`) or off; returns whether they are on."""
    global _enabled
    _enabled = bool(on) and supported(device)
    return _enabled


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def enabled_within(device: torch.device | str) -> Iterator[bool]:
    """Early launches on (where `supported`) for what is launched or captured inside, as
    before after; yields whether they were on."""
    global _enabled
    before = _enabled
    _enabled = supported(device)
    try:
        yield _enabled
    finally:
        _enabled = before


def kernel_args() -> dict[str, bool]:
    """Keyword arguments of a taking-part kernel's launch: its ``PDL`` constant and Triton's
    launch attribute, both off unless `enable`d."""
    if not _enabled:
        return {}
    return {"PDL": True, "launch_pdl": True}
