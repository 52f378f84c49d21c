"""The built-in default model: a seeded random ``tiny`` checkpoint, written once to the cache.

It needs no download and answers with random words (weights/readable.py: a word vocabulary,
and captions whose length follows ``--length``); point the server at real moondream2 weights
(``--model``) for real answers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from vlm_server.models.registry import preset, write_checkpoint

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
# Written last by every family's writer: its presence means the checkpoint is complete.
_DONE = "config.json"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moondream-serve"


def default_model_dir(preset_name: str = DEFAULT_PRESET, seed: int = DEFAULT_SEED) -> Path:
    """Directory of the default checkpoint, written on first use (safe against concurrent
    writers: each writes a private temporary directory and renames it into place)."""
    # "-words": the readable model; "-v2": its config names the reasoning markers. Older
    # checkpoints under their old names are left alone.
    target = cache_root() / "models" / f"{preset_name}-seed{seed}-words-v2"
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config = preset(preset_name)
        write_checkpoint(config, tmp, seed=seed, progress=False, readable=True)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
