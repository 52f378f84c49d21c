"""``vlm quantize``: write a checkpoint's weights ahead in INT8 or INT4 (docs/quantization.md).

    vlm quantize SRC DST --weights int4 [--vision] [--group-size 128] [--preset NAME]

reads SRC (a checkpoint directory in any layout the server loads; FP8 experts are widened
to bf16 first), writes DST (the non-weight files copied, quantized safetensors) and prints
what it quantized, what it left in bf16 and why, and the bytes before and after. Exit status
0 when written, 1 when SRC cannot be read or DST written, 2 on bad flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.quant.formats import GROUP_SIZE, GROUP_SIZES, QuantError
from vlm_server.models.quantized import QuantizeReport, quantize_checkpoint

WEIGHTS = ("int8", "int4")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="the checkpoint directory to read")
    parser.add_argument("dst", type=Path, help="the new directory to write (absent or empty)")
    parser.add_argument("--weights", required=True, choices=WEIGHTS, help="the stored format")
    parser.add_argument(
        "--vision", action="store_true", help="quantize the vision tower's block linears too"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=GROUP_SIZE,
        choices=GROUP_SIZES,
        help=f"INT4 input columns per scale (the kernels take {GROUP_SIZE}) [default {GROUP_SIZE}]",
    )
    parser.add_argument(
        "--preset", default=None, help="the model's preset, for a SRC whose config.json names none"
    )
    return parser


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def report_lines(report: QuantizeReport) -> list[str]:
    """The command's summary of ``report``."""
    lines = [f"{report.family}: {len(report.quantized)} weights in {report.weights}"]
    lines += [f"  {name}" for name in report.quantized]
    if report.kept:
        lines.append(f"kept in bf16: {len(report.kept)}")
        lines += [f"  {name} ({why})" for name, why in report.kept.items()]
    ratio = report.bytes_after / report.bytes_before if report.bytes_before else 0.0
    lines.append(
        f"bytes: {report.bytes_before} ({_mib(report.bytes_before)}) in bf16 -> "
        f"{report.bytes_after} ({_mib(report.bytes_after)}), {ratio:.1%}"
    )
    lines += [f"wrote {path}" for path in report.files]
    return lines


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        report = quantize_checkpoint(
            args.src,
            args.dst,
            args.weights,
            vision=args.vision,
            group_size=args.group_size,
            preset_name=args.preset,
        )
    except (CheckpointError, QuantError, ValueError, OSError) as err:
        print(f"vlm quantize: error: {err}", file=sys.stderr)
        return 1
    print("\n".join(report_lines(report)))
    return 0
