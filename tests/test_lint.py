"""The tree stays `ruff check` and `ruff format` clean (CI runs this with the suite)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return [found]


@pytest.mark.parametrize("args", [["check", "-q", "."], ["format", "--check", "-q", "."]])
def test_the_tree_is_ruff_clean(args: list[str]) -> None:
    done = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
