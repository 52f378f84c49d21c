"""The chip table: its doc is generated, devices are matched to it, its limits reach the
kernels' launch choices."""

from __future__ import annotations

from pathlib import Path

from tests.support.hardware_doc import COMMAND, render
from vlm_server.chips import CHIPS, KIB, from_device, known, limits_of

ROOT = Path(__file__).resolve().parents[1]


def test_docs_hardware_is_generated_from_the_table() -> None:
    text = (ROOT / "docs" / "hardware.md").read_text()
    assert text == render(), f"docs/hardware.md is stale: run {COMMAND}"
    for chip in CHIPS:
        assert f"| {chip.name} |" in text


def test_a_device_is_matched_to_its_table_entry_and_its_own_figures_win() -> None:
    assert known("NVIDIA H100 80GB HBM3", (9, 0)).name == "H100"
    assert known("NVIDIA H100 PCIe", (9, 0)).name == "H100 PCIe"
    assert known("NVIDIA GB10", (12, 1)).name == "GB10"
    assert known("NVIDIA GeForce RTX 4090", (8, 9)).name == "RTX 4090"
    assert known("NVIDIA A10", (8, 6)).name == "A10"
    assert known("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0)).name.startswith("RTX PRO")
    assert known("NVIDIA H200", (8, 9)) is None  # the capability must agree
    chip = from_device("NVIDIA GeForce RTX 4090", (8, 9), 128, 25_386_000_000, 101376)
    assert (chip.bandwidth_gbs, chip.limits.shared_per_block, chip.fp8) == (1008, 101376, True)
    unknown = from_device("Some Future GPU", (12, 3), 10, 8_000_000_000, 0)
    assert unknown.bandwidth_gbs == 0 and unknown.limits == limits_of((12, 1))


def test_limits_by_capability() -> None:
    assert limits_of((8, 6)).shared_per_block == 99 * KIB
    assert limits_of((9, 0)).shared_per_block == 227 * KIB
    assert limits_of((8, 0)).shared_per_block == 163 * KIB
    assert limits_of((7, 5)).shared_per_block == 99 * KIB  # older than the table: the least


def test_the_stage_counts_follow_the_chip() -> None:
    from vlm_server.chips import ChipSpec
    from vlm_server.models.common import skinny_gemm
    from vlm_server.models.moondream3 import moe_triton

    small, big = ChipSpec("a", (8, 6), 1, 1, 1), ChipSpec("b", (9, 0), 1, 1, 1)
    for launch_configs in (skinny_gemm.launch_configs, moe_triton.launch_configs):
        stages = {str(c.constants) + c.kernel: c.stages for c in launch_configs(small)}
        more = {str(c.constants) + c.kernel: c.stages for c in launch_configs(big)}
        assert any(more[k] > s for k, s in stages.items() if k in more)
