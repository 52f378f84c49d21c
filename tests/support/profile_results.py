"""The table tests/run_gpu_profiles.sh ends with: per chip profile, the GPU tests passed,
failed, in error and skipped (from each run's JUnit XML), whether the run was cut short, and
its slowest tests.

    python -m tests.support.profile_results RESULTS_DIR
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ProfileRun:
    """One profile's results."""

    name: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    cut: bool = False
    slowest: list[tuple[float, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def read_run(xml: Path) -> ProfileRun:
    """A JUnit XML file (pytest's) as counts; the run is cut where ``<name>.cut`` exists."""
    run = ProfileRun(xml.stem, cut=xml.with_suffix(".cut").exists())
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        took = float(case.get("time") or 0.0)
        run.seconds += took
        run.slowest.append((took, name))
        if case.find("failure") is not None:
            run.failed += 1
            run.failures.append(name)
        elif case.find("error") is not None:
            run.errors += 1
            run.failures.append(name)
        elif case.find("skipped") is not None:
            run.skipped += 1
        else:
            run.passed += 1
    run.slowest = sorted(run.slowest, reverse=True)[:5]
    return run


def table(runs: list[ProfileRun]) -> str:
    """The runs' counts, one row each, then each run's failures and slowest tests."""
    lines = [f"{'profile':<10} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7} {'s':>7}"]
    for r in runs:
        cut = "  (cut short: time limit)" if r.cut else ""
        lines.append(
            f"{r.name:<10} {r.passed:>6} {r.failed:>6} {r.errors:>6} {r.skipped:>7} "
            f"{r.seconds:>7.1f}{cut}"
        )
    for r in runs:
        for name in r.failures:
            lines.append(f"{r.name}: FAILED {name}")
        for took, name in r.slowest:
            lines.append(f"{r.name}: {took:6.1f} s {name}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(argv[0])
    runs = [read_run(p) for p in sorted(folder.glob("*.xml"))]
    if not runs:
        print(f"no results in {folder}", file=sys.stderr)
        return 1
    print(table(runs))
    return 1 if any(r.failed or r.errors for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
