"""Folders of small distinct pictures and the engine flags the ``vlm batch`` tests share."""

from __future__ import annotations

from pathlib import Path

from tests.support.jpegs import encode, photo


def write_pictures(folder: Path, count: int) -> list[str]:
    """``count`` small pictures, each its own, alternately JPEG and PNG, every third one in
    a subfolder; their paths relative to ``folder``, sorted."""
    names = []
    for i in range(count):
        fmt, suffix = ("JPEG", "jpg") if i % 2 == 0 else ("PNG", "png")
        name = f"{'nested/' if i % 3 == 2 else ''}pic{i:03d}.{suffix}"
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode(photo(40 + 4 * (i % 5), 32 + 2 * (i % 3), seed=i), fmt))
        names.append(name)
    return sorted(names)


def engine_flags(model: Path, max_batch_size: int = 4) -> list[str]:
    """The tiny model on the CPU, with a small KV budget."""
    return [
        "--model", str(model), "--device", "cpu", "--dtype", "fp32",
        "--max-batch-size", str(max_batch_size), "--kv-budget-bytes", "16MiB",
    ]  # fmt: skip
