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


def write_rows(json_path: str, out: dict, plot: Callable[[dict, str], bool]) -> None:
    """A probe's ``--json``: its rows as JSON, and its plot of them beside."""
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, png_beside(json_path))


def replot(json_path: str, plot: Callable[[dict, str], bool]) -> int:
    """A probe's ``--plot-from``: its plot of saved rows, beside them; exit status."""
    with open(json_path) as f:
        return 0 if plot(json.load(f), png_beside(json_path)) else 1


def grouped_bars(
    bars: dict[str, list[float]],
    labels: list[str],
    path: str,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    log: bool = False,
) -> bool:
    """One group of bars per label, one bar per series in ``bars``; False without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(bars))
    middle = (len(bars) - 1) / 2
    for i, (name, values) in enumerate(bars.items()):
        xs = [x + (i - middle) * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    if log:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    save(plt, fig, path)
    return True
