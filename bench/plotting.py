"""What the probes' plots share: matplotlib without a display, if installed, and the PNG
written beside a JSON of rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the file-only backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: ModuleType, fig: Any, path: str) -> None:
    """Write ``fig`` to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def png_beside(json_path: str) -> str:
    return json_path.removesuffix(".json") + ".png"


def replot(json_path: str, plot: Callable[[dict, str], bool]) -> int:
    """A probe's ``--plot-from``: its plot of saved rows, beside them; exit status."""
    with open(json_path) as f:
        return 0 if plot(json.load(f), png_beside(json_path)) else 1
