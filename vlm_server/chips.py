"""What each GPU our users own can do: one table of published figures, and the limits a kernel
launch must fit (torch-free, so that tests, docs and the kernels' launch choices read it alike).

The device says some of this itself at start (name, compute capability, SM count, memory,
shared memory per block; chip_features.device_spec reads it); the table fills what it cannot
say (bandwidth, matrix instructions, registers) and names the chips the docs list
(docs/hardware.md is rendered from `CHIPS` by `markdown_table`). A chip missing from the
table gets its compute capability's limits (`limits_of`).

Figures are NVIDIA's published ones: the CUDA C++ Programming Guide's table of compute
capabilities (shared memory, registers) and each product's data sheet (SMs, memory,
bandwidth; the SXM form where a chip comes in several).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

KIB = 1 << 10
GIB = 1 << 30
FP8_CAPABILITY = (8, 9)  # FP8 matrix units: Ada, Hopper, Blackwell


@dataclass(frozen=True)
class Limits:
    """What one compute capability grants one block of threads (CUDA Programming Guide)."""

    shared_per_block: int  # bytes one block may opt in to (cudaFuncAttributeMaxDynamicShared...)
    shared_per_sm: int  # bytes
    registers_per_sm: int = 64 * KIB  # 32-bit registers
    registers_per_block: int = 64 * KIB
    registers_per_thread: int = 255
    threads_per_block: int = 1024
    matrix: str = "mma"  # tensor-core instructions: mma (sm_80+), wgmma (sm_90), tcgen05
    tma: bool = False  # the Tensor Memory Accelerator (bulk async copies), sm_90 and later


# By compute capability. Shared memory per SM less 1 KiB the driver keeps per block.
LIMITS: dict[tuple[int, int], Limits] = {
    (8, 0): Limits(163 * KIB, 164 * KIB),
    (8, 6): Limits(99 * KIB, 100 * KIB),
    (8, 7): Limits(163 * KIB, 164 * KIB),
    (8, 9): Limits(99 * KIB, 100 * KIB),
    (9, 0): Limits(227 * KIB, 228 * KIB, matrix="wgmma", tma=True),
    (10, 0): Limits(227 * KIB, 228 * KIB, matrix="tcgen05", tma=True),
    (11, 0): Limits(227 * KIB, 228 * KIB, matrix="tcgen05", tma=True),
    (12, 0): Limits(99 * KIB, 100 * KIB, tma=True),
    (12, 1): Limits(99 * KIB, 100 * KIB, tma=True),
}


def limits_of(capability: tuple[int, int]) -> Limits:
    """The limits of ``capability``; one the table lacks gets its family's nearest older
    entry (a newer minor revision keeps its major's limits), else the smallest of them."""
    if capability in LIMITS:
        return LIMITS[capability]
    older = [c for c in LIMITS if c[0] == capability[0] and c <= capability]
    if older:
        return LIMITS[max(older)]
    return min(LIMITS.values(), key=lambda lim: lim.shared_per_block)


@dataclass(frozen=True)
class ChipSpec:
    """One chip: what the device reports at start, the rest from the table."""

    name: str
    capability: tuple[int, int]
    sms: int
    memory_gb: float  # GB as the data sheet counts them (10^9 bytes)
    bandwidth_gbs: float  # GB/s; 0: unknown (the device does not report it)
    limits: Limits = field(default=None)  # type: ignore[assignment]  # filled from LIMITS
    # GiB the driver reports (what the engine can plan with: a "24 GB" card reports about
    # 23.6); 0: the data sheet's figure.
    reported_gib: float = 0.0

    def __post_init__(self) -> None:
        if self.limits is None:
            object.__setattr__(self, "limits", limits_of(self.capability))

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def fp8(self) -> bool:
        return self.capability >= FP8_CAPABILITY

    @property
    def memory_bytes(self) -> int:
        """The device memory to plan with (`reported_gib`, else the data sheet's)."""
        if self.reported_gib:
            return int(self.reported_gib * GIB)
        return int(self.memory_gb * 1e9)


CHIPS: tuple[ChipSpec, ...] = (
    ChipSpec("RTX 3060", (8, 6), 28, 12, 360, reported_gib=11.76),
    ChipSpec("A10", (8, 6), 72, 24, 600, reported_gib=22.07),
    ChipSpec("RTX 3090", (8, 6), 82, 24, 936, reported_gib=23.57),
    ChipSpec("A100 40GB", (8, 0), 108, 40, 1555, reported_gib=39.39),
    ChipSpec("A100 80GB", (8, 0), 108, 80, 2039, reported_gib=79.15),
    ChipSpec("Jetson AGX Orin 64GB", (8, 7), 16, 64, 204.8),
    ChipSpec("L4", (8, 9), 58, 24, 300, reported_gib=22.03),
    ChipSpec("L40S", (8, 9), 142, 48, 864, reported_gib=44.39),
    ChipSpec("RTX 4090", (8, 9), 128, 24, 1008, reported_gib=23.52),
    ChipSpec("H100", (9, 0), 132, 80, 3350, reported_gib=79.11),
    ChipSpec("H100 PCIe", (9, 0), 114, 80, 2000),
    ChipSpec("H200", (9, 0), 132, 141, 4800, reported_gib=139.8),
    ChipSpec("B200", (10, 0), 148, 180, 8000),
    ChipSpec("Jetson AGX Thor", (11, 0), 20, 128, 273),
    ChipSpec("RTX 5090", (12, 0), 170, 32, 1792, reported_gib=31.36),
    ChipSpec("RTX PRO 6000 Blackwell", (12, 0), 188, 96, 1792),
    ChipSpec("GB10", (12, 1), 48, 128, 273),
)

# The compute capabilities the kernels are proven to fit (tests/test_kernels_fit_chips.py).
TARGETS: tuple[tuple[int, int], ...] = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))


def _words(name: str) -> set[str]:
    return set(name.upper().replace("-", " ").replace("(", " ").replace(")", " ").split())


def known(name: str, capability: tuple[int, int]) -> ChipSpec | None:
    """The table's entry for a device that calls itself ``name`` (``NVIDIA H100 80GB HBM3``,
    ``NVIDIA GeForce RTX 4090``): the entry of that capability whose name's words all
    appear in it, the longest such name first; None where none matches."""
    words = _words(name)
    fits = [c for c in CHIPS if c.capability == capability and _words(c.name) <= words]
    return max(fits, key=lambda c: len(c.name)) if fits else None


def from_device(
    name: str,
    capability: tuple[int, int],
    sms: int,
    memory_bytes: int,
    shared_per_block: int = 0,
) -> ChipSpec:
    """The chip a device reports (``shared_per_block`` 0: not reported), with the table's
    figures for what it does not report. The device's own figures win over the table's."""
    table = known(name, capability)
    limits = limits_of(capability)
    if shared_per_block:
        limits = replace(limits, shared_per_block=shared_per_block)
    return ChipSpec(
        name,
        capability,
        sms,
        round(memory_bytes / 1e9, 1),
        table.bandwidth_gbs if table is not None else 0,
        limits,
    )


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def by_name(name: str) -> ChipSpec:
    """The chip a person names (case, spaces and dashes ignored, and a vendor prefix such as
    "NVIDIA GeForce"); ValueError naming the ones known."""
    key = _key(name)
    for prefix in ("nvidiageforce", "nvidia", "geforce"):
        key = key.removeprefix(prefix)
    for chip in CHIPS:
        if _key(chip.name) == key:
            return chip
    raise ValueError(f"gpu: unknown card {name!r}; known: {', '.join(c.name for c in CHIPS)}")


# Short names of the chips a profile runs as (--chip-profile): the key of a chip's name, and
# these for chips whose name says more than people type.
PROFILE_ALIASES = {"a100": "A100 80GB", "rtxpro6000": "RTX PRO 6000 Blackwell"}


def profile(name: str) -> ChipSpec:
    """The chip ``--chip-profile NAME`` makes the engine behave as (``rtx3090``, ``a100``,
    ``RTX 4090``); ValueError naming the field and the names known."""
    try:
        return by_name(PROFILE_ALIASES.get(_key(name), name))
    except ValueError:
        names = sorted({_key(c.name) for c in CHIPS} | set(PROFILE_ALIASES))
        raise ValueError(
            f"chip_profile: unknown chip {name!r}; known: {', '.join(names)}"
        ) from None


@dataclass(frozen=True)
class Launch:
    """One launch configuration a kernel's launcher may pick: the kernel (its name in its
    module), the tile constants it passes, argument types where they differ from the
    kernel's usual ones (FP8 weights), warps and pipeline stages."""

    kernel: str
    constants: Mapping[str, object]
    warps: int = 4
    stages: int = 3
    types: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        tiles = ",".join(f"{k}={v}" for k, v in sorted(self.constants.items()))
        return f"{self.kernel}[{tiles}]w{self.warps}s{self.stages}"


def markdown_table(chips: tuple[ChipSpec, ...] = CHIPS) -> str:
    """The chip table as docs/hardware.md shows it."""
    head = (
        "| Chip | Compute capability | Shared memory per block (opt-in) | Registers per SM "
        "/ per thread | SMs | FP8 units | Memory | Bandwidth | Matrix instructions | TMA |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in chips:
        lim = c.limits
        rows.append(
            f"| {c.name} | {c.capability[0]}.{c.capability[1]} ({c.sm}) "
            f"| {lim.shared_per_block // KIB} KiB | {lim.registers_per_sm // KIB}K / "
            f"{lim.registers_per_thread} | {c.sms} | {'yes' if c.fp8 else 'no'} "
            f"| {c.memory_gb:g} GB | {c.bandwidth_gbs:g} GB/s | {lim.matrix} "
            f"| {'yes' if lim.tma else 'no'} |"
        )
    return head + "\n".join(rows) + "\n"
