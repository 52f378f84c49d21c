"""Every launch configuration the code can pick on a chip fits that chip: each kernel is
compiled ahead of time for sm_80, 86, 89, 90, 100 and 120 (no GPU needed) with the warps and
pipeline stages its launcher would pass there, and the compiled kernel's shared memory
(Triton's metadata) and registers (read from the cubin: tests/support/cubin.py) are checked
against that compute capability's limits (vlm_server/chips.py).

Kernels whose launch shape depends on the chip expose ``launch_configs(chip)`` (skinny_gemm,
quant_gemm, lora_kernel's shrink, moe_triton); the rest launch as
tests/support/triton_kernels.py lists them, whatever the chip. The whole matrix takes
minutes (marked slow); the default suite checks the largest configuration of each kernel
whose tiles the chip cuts on sm_86 (the least shared memory of the six), the other chips'
with --run-slow.

Under Triton 3.9 a stage count does not change these kernels' shared memory (their K loops
are not software-pipelined: one stage of tiles is what a compile reserves), so the
launchers' stage fitting is a safeguard, and the size a tile takes is checked directly.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import pytest

from tests.support.cubin import usage
from tests.support.triton_kernels import KERNELS, TARGETS, Kernel, jit_function, source
from vlm_server.chips import ChipSpec, Launch, Limits, limits_of

triton = pytest.importorskip("triton")

# Compiling for a chip needs Triton's compiler: a process run wholly in its interpreter (every
# kernel an InterpretedFunction) has none to give.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="compiles kernels for each chip: not under TRITON_INTERPRET=1",
)


@pytest.fixture(autouse=True)
def _fp_fusion_as_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile as the device's Triton launches the kernels: FP fusion on (newer Triton
    releases warn while the default is left unset, and will turn it off)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


from vlm_server.models.common import lora_kernel, quant_gemm, skinny_gemm  # noqa: E402
from vlm_server.models.moondream3 import moe_triton  # noqa: E402

LAUNCHERS: dict[str, Callable[[ChipSpec], list[Launch]]] = {
    skinny_gemm.__name__: skinny_gemm.launch_configs,
    lora_kernel.__name__: lora_kernel.launch_configs,
    moe_triton.__name__: moe_triton.launch_configs,
    quant_gemm.__name__: quant_gemm.launch_configs,
}


@dataclasses.dataclass(frozen=True)
class Config:
    kernel: Kernel
    stages: int = 3  # Triton's default where the launcher passes none

    def __str__(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in sorted(self.kernel.constants.items()))
        return f"{self.kernel.name}[{consts}]w{self.kernel.warps}s{self.stages}"


def _chip(arch: int) -> ChipSpec:
    return ChipSpec(f"sm_{arch}", divmod(arch, 10), 0, 0, 0)


def _covered(launchers: tuple[str, ...] = tuple(LAUNCHERS)) -> set[tuple[str, str]]:
    chip = _chip(90)
    return {(m, launch.kernel) for m in launchers for launch in LAUNCHERS[m](chip)}


# The default suite's share: the kernels whose tiles the chip's shared memory cuts (the LoRA
# shrink's stay within 64 KiB on every chip, by construction).
FITTED = (skinny_gemm.__name__, moe_triton.__name__, quant_gemm.__name__)


def configs(arch: int) -> list[Config]:
    """Every launch configuration the code can pick on sm_``arch``."""
    covered = _covered()
    out = [Config(k) for k in KERNELS if (k.module, k.name) not in covered]
    for module, launch_configs in LAUNCHERS.items():
        for launch in launch_configs(_chip(arch)):
            listed = [k for k in KERNELS if (k.module, k.name) == (module, launch.kernel)]
            # The kernel's listed forms, one with and one without early launch (PDL).
            bases = {bool(k.constants.get("PDL")): k for k in reversed(listed)}
            for base in bases.values():
                kernel = dataclasses.replace(
                    base,
                    signature={**base.signature, **launch.types},
                    constants={**base.constants, **launch.constants},
                    warps=launch.warps,
                )
                out.append(Config(kernel, launch.stages))
    return [c for c in out if arch >= c.kernel.min_arch]


def _size(config: Config) -> int:
    """Tile elements times stages: the largest configuration of a kernel by this."""
    tiles = [v for k, v in config.kernel.constants.items() if k.startswith(("BLOCK", "B"))]
    return math.prod(v for v in tiles if isinstance(v, int) and v > 1) * config.stages


def largest(arch: int) -> list[Config]:
    """The largest configuration of each kernel the chip's shared memory fits (`FITTED`) on
    sm_``arch``, early launch left out (the default suite's share of the matrix)."""
    best: dict[tuple[str, str], Config] = {}
    fitted = _covered(FITTED)
    for c in configs(arch):
        key = (c.kernel.module, c.kernel.name)
        if key not in fitted or c.kernel.constants.get("PDL"):
            continue
        if key not in best or _size(c) > _size(best[key]):
            best[key] = c
    return list(best.values())


def overruns(config: Config, arch: int, limits: Limits) -> list[str]:
    """Where the compiled configuration exceeds ``limits`` (none: it fits)."""
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": config.kernel.warps, "num_stages": config.stages}
    src = source(jit_function(config.kernel), config.kernel)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    shared = compiled.metadata.shared
    regs = usage(compiled.asm["cubin"], compiled.metadata.name).registers
    threads = config.kernel.warps * 32
    # Registers are allocated per warp, in units of 256 (8 a thread).
    block_regs = -(-regs // 8) * 8 * threads
    out = []
    if shared > limits.shared_per_block:
        out.append(f"shared memory {shared} > {limits.shared_per_block} bytes")
    if regs > limits.registers_per_thread:
        out.append(f"{regs} registers a thread > {limits.registers_per_thread}")
    if block_regs > limits.registers_per_block:
        out.append(f"{block_regs} registers a block > {limits.registers_per_block}")
    if threads > limits.threads_per_block:
        out.append(f"{threads} threads > {limits.threads_per_block}")
    return out


def _check(arch: int, chosen: list[Config]) -> None:
    limits = limits_of(divmod(arch, 10))
    bad = [f"{c}: {'; '.join(o)}" for c in chosen if (o := overruns(c, arch, limits))]
    assert not bad, f"sm_{arch}: configurations over its limits:\n" + "\n".join(bad)


IDS = [f"sm_{a}" for a in TARGETS]
# The default suite's chip: the least shared memory a block of the six (99 KB, as sm_89 and
# sm_120), where a tile that fits sm_90 first overruns; the others run with --run-slow.
FAST_TARGET = 86
LARGEST = [
    pytest.param(a, id=f"sm_{a}", marks=() if a == FAST_TARGET else pytest.mark.slow)
    for a in TARGETS
]


@pytest.mark.parametrize("arch", LARGEST)
def test_the_largest_launch_of_each_chip_dependent_kernel_fits(arch: int) -> None:
    chosen = largest(arch)
    assert {(c.kernel.module, c.kernel.name) for c in chosen} == _covered(FITTED)
    _check(arch, chosen)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TARGETS, ids=IDS)
def test_every_launch_configuration_fits_the_chip(arch: int) -> None:
    _check(arch, configs(arch))


def test_an_oversized_configuration_is_caught() -> None:
    """The prefill tile of the expert kernels with a K step four times as wide: one stage of
    its tiles is then 192 KiB, past an sm_86's 99 and within an sm_90's 227."""
    launch = next(
        c for c in configs(86) if c.kernel.name == "_up_kernel" and c.kernel.constants["BM"] == 128
    )
    wide = {**launch.kernel.constants, "BK": 4 * launch.kernel.constants["BK"]}
    oversized = dataclasses.replace(
        launch, kernel=dataclasses.replace(launch.kernel, constants=wide)
    )
    problems = overruns(oversized, 86, limits_of((8, 6)))
    assert problems and problems[0].startswith("shared memory"), problems
    assert not overruns(oversized, 90, limits_of((9, 0)))


def test_every_chip_dependent_kernel_is_listed() -> None:
    """Each launch configuration names a kernel tests/support/triton_kernels.py lists (its
    argument types come from there)."""
    listed = {(k.module, k.name) for k in KERNELS}
    assert _covered() <= listed
