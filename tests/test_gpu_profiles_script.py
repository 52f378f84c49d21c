"""tests/run_gpu_profiles.sh and its table (tests/support/profile_results.py): on the CPU
every GPU test skips, and the table counts what each profile's JUnit XML holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import profile_results

REPO = Path(__file__).resolve().parents[1]

_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="test_ok" time="2.5"/>
<testcase classname="tests.a" name="test_bad" time="1.0"><failure message="x"/></testcase>
<testcase classname="tests.b" name="test_broken" time="0.1"><error message="y"/></testcase>
<testcase classname="tests.b" name="test_gpu" time="0.0"><skipped message="z"/></testcase>
</testsuite></testsuites>"""


def test_the_table_counts_each_outcome_and_says_a_run_was_cut(tmp_path: Path) -> None:
    (tmp_path / "rtx3090.xml").write_text(_XML)
    (tmp_path / "rtx3090.cut").touch()
    run = profile_results.read_run(tmp_path / "rtx3090.xml")
    assert (run.passed, run.failed, run.errors, run.skipped) == (1, 1, 1, 1)
    assert run.cut and run.slowest[0] == (2.5, "tests.a::test_ok")
    text = profile_results.table([run])
    assert "(cut short: time limit)" in text and "FAILED tests.a::test_bad" in text
    assert profile_results.main([str(tmp_path)]) == 1  # a failure fails the run
    assert profile_results.main([str(tmp_path / "none")]) == 1


def test_the_script_runs_the_gpu_tests_under_a_profile(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        RESULTS=str(tmp_path),
        PYTEST_ARGS="tests/test_compile_clock.py tests/test_moondream3_moe_norm.py",
        GPU_PROFILE_BUDGET_S="300",
        PYTHON=sys.executable,
    )
    out = subprocess.run(
        ["bash", "tests/run_gpu_profiles.sh", "a100"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("a100 "))
    assert row.split()[1:5] == ["0", "0", "0", "3"]  # the three GPU tests, skipped here
    assert (tmp_path / "a100.xml").exists() and not (tmp_path / "a100.cut").exists()
