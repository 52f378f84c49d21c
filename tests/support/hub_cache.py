"""A Hugging Face Hub cache on disk, for the offline resolution tests: a repo's snapshot, and
Python run with the cache and offline mode set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, repo_id: str) -> Path:
    """The (empty) snapshot folder of ``repo_id`` at ``main`` in the cache ``cache``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def run_offline(code: str, cache: Path) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with ``cache`` as the Hub cache and the Hub offline."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
