"""docs/hardware.md, rendered from the chip table (vlm_server/chips.py) and the kernels'
launch configurations per chip: ``python -m tests.support.hardware_doc > docs/hardware.md``.
(A developer's tool, outside the package: only the registry imports a model family there.)"""

from __future__ import annotations

import sys

from vlm_server.chips import CHIPS, TARGETS, ChipSpec, markdown_table
from vlm_server.models.common import lora_kernel, skinny_gemm
from vlm_server.models.moondream3 import moe_triton

COMMAND = "python -m tests.support.hardware_doc > docs/hardware.md"
LAUNCHERS = {
    "skinny_gemm": skinny_gemm.launch_configs,
    "lora_kernel": lora_kernel.launch_configs,
    "moe_triton": moe_triton.launch_configs,
}

INTRO = """\
# Hardware

<!-- Generated from vlm_server/chips.py: {command} -->

The chips the server is built for, with NVIDIA's published figures (the CUDA C++
Programming Guide's compute-capability table for shared memory and registers; each
product's data sheet for SMs, memory and bandwidth, the SXM form where there are several).
At start the server reads the device's own name, compute capability, SM count, memory and
shared memory per block (`chip_features.device_spec`); the table fills the rest. A chip
missing from the table gets its compute capability's limits.

`--chip-profile NAME` (or `VLM_CHIP_PROFILE`; e.g. `rtx3090`, `rtx4090`, `a100`: a chip's
name without spaces) runs a GPU as that chip of the table: its compute capability, SM count
and limits for every launch choice and feature gate (no FP8 below sm_89, no early launches
below sm_90), and its memory as the engine's cap unless `--gpu-memory-bytes` is given. It
runs the smaller chip's code paths on a larger GPU; timings under a profile are that GPU's,
not the chip's. `tests/run_gpu_profiles.sh` runs the GPU tests natively and under the
`rtx3090`, `rtx4090` and `a100` profiles and prints a table of each run's counts.

"""

KERNELS = """
## Launch configurations per chip

Every Triton kernel is compiled for sm_80, 86, 89, 90, 100 and 120 with each launch
configuration its launcher can pick there, and its shared memory and registers are checked
against that chip's limits (`tests/test_kernels_fit_chips.py`; the whole matrix with
`--run-slow`). The kernels whose tiles depend on the chip list them through
`launch_configs(chip)`; the pipeline stages below are what the launcher passes on each chip
(`w` warps, `s` stages). The other kernels launch alike on every chip
(`tests/support/triton_kernels.py`). FP8 expert weights and activations, and the vision
tower's FP8 kernels (`--vision-fp8`), run on every chip with FP8 units: sm_89 and newer.

"""


def _configs(chip: ChipSpec) -> str:
    lines = []
    for module, launch_configs in LAUNCHERS.items():
        for launch in launch_configs(chip):
            types = ", ".join(f"{k} {v}" for k, v in sorted(launch.types.items()))
            lines.append(f"- `{module}.{launch}`" + (f" ({types})" if types else ""))
    return "\n".join(lines)


def render() -> str:
    parts = [INTRO.format(command=COMMAND), markdown_table(CHIPS), KERNELS]
    for cap in TARGETS:
        chip = ChipSpec(f"sm_{cap[0]}{cap[1]}", cap, 0, 0, 0)
        names = ", ".join(c.name for c in CHIPS if c.limits == chip.limits) or "none listed"
        parts.append(f"### {chip.sm} ({names})\n\n{_configs(chip)}\n\n")
    return "".join(parts).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
