"""Inspect how an image would be prepared: ``python -m image_pipeline [FILE]``.

Without FILE the built-in sample picture is used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import ImageError, prepare_image, sample_image_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m image_pipeline", description=__doc__)
    parser.add_argument("file", nargs="?", type=Path, help="image file (default: sample)")
    args = parser.parse_args(argv)

    data = args.file.read_bytes() if args.file else sample_image_bytes()
    start = time.perf_counter()
    try:
        prepared = prepare_image(data)
    except ImageError as exc:
        print(f"refused ({exc.reason.value}): {exc.message}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    h_t, w_t = prepared.tiling
    print(f"source:       {args.file or 'built-in sample'} ({len(data)} bytes)")
    print(f"size:         {prepared.width}x{prepared.height} (w x h, upright)")
    print(f"decoded:      {prepared.decoded_size[1]}x{prepared.decoded_size[0]}")
    print(f"tiling:       {h_t}x{w_t} -> {prepared.num_crops} crops {tuple(prepared.crops.shape)}")
    print(f"content hash: {prepared.content_hash}")
    print(f"time:         {elapsed * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
