"""The engine's step trace (--step-trace) and the analysis that reads it (bench/step_gaps.py)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from bench import step_gaps
from image_pipeline import PreparedImage
from tests.support.service_harness import local_config
from vlm_server.engine import step_trace
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.core.pipeline import LaunchKind, Step
from vlm_server.engine.engine import BatchedEngine
from vlm_server.server.engines import batched_engine
from vlm_server.server.in_process import InProcessEngine


def _serve(batched: BatchedEngine, requests: list[GenerationRequest]) -> list[Finished]:
    engine = InProcessEngine(batched)

    async def run() -> list[Finished]:
        await engine.start()
        try:

            async def one(req: GenerationRequest) -> Finished:
                last = None
                async for event in await engine.submit(req):
                    last = event
                assert isinstance(last, Finished)
                return last

            return list(await asyncio.gather(*[one(r) for r in requests]))
        finally:
            await engine.close()

    return asyncio.run(run())


def test_a_served_engine_writes_its_steps_when_it_stops(
    tiny_dir: Path, sample_image: PreparedImage, tmp_path: Path
) -> None:
    path = tmp_path / "trace" / "steps.json"
    config = local_config(model=str(tiny_dir), device="cpu", dtype="fp32", step_trace=str(path))
    engine = batched_engine(config)
    assert isinstance(engine.observer, step_trace.StepTrace)
    requests = [
        GenerationRequest(Task.CAPTION, sample_image, max_tokens=6, temperature=0),
        GenerationRequest(Task.QUERY, sample_image, question="What?", max_tokens=4),
    ]
    done = _serve(engine, requests)
    rows = step_trace.load(path)
    assert json.loads(path.read_text())["fields"] == list(step_trace.FIELDS)
    # Every output token came out of a committed step with that row in it.
    assert sum(r["decode_rows"] for r in rows) + sum(
        1 for r in rows if r["kind"] == "mixed"
    ) >= max(d.metrics.output_tokens for d in done)
    ids = [r["step"] for r in rows]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert {r["kind"] for r in rows} == {"decode", "mixed"}
    times = [r["t"] for r in rows]
    assert times == sorted(times)
    for r in rows:
        assert r["commit_ms"] >= r["wait_ms"] >= 0 and r["tick_wall_ms"] >= 0
        assert r["gc_ms"] >= 0 and r["prefill"] in (True, False)
        assert r["forward_ms"] is None  # CPU events carry no clock


def test_the_trace_keeps_the_latest_steps_and_counts_collections(tmp_path: Path) -> None:
    trace = step_trace.StepTrace(tmp_path / "t.json", max_steps=3)
    for i in range(5):
        step = Step(step_id=i, slot=i % 2, kind=LaunchKind.DECODE, seqs=[object(), object()])
        trace.launched(step)
        trace.committed(step)
        trace.waited(0.001)
        if i == 4:  # a collection between two commits lands on the second
            trace._on_gc("start", {"generation": 2})
            time.sleep(0.002)
            trace._on_gc("stop", {"generation": 2})
        trace.tick(0.002, 0.0005, 0.0005)
    trace.closed()
    rows = step_trace.load(tmp_path / "t.json")
    assert [r["step"] for r in rows] == [2, 3, 4]
    assert rows[-1]["gc_ms"] >= 2.0 and rows[0]["gc_ms"] == 0.0
    assert rows[0]["decode_rows"] == 2 and rows[0]["wait_ms"] == 1.0
    with pytest.raises(ValueError, match="step_trace_steps"):
        step_trace.StepTrace(tmp_path / "u.json", max_steps=0)


def _row(t: float, kind: str = "decode", decode_rows: int = 16, **kw: object) -> dict:
    row = dict.fromkeys(step_trace.FIELDS)
    row.update(
        t=t,
        step=0,
        kind=kind,
        rows=decode_rows,
        decode_rows=decode_rows,
        prefill=False,
        wait_ms=0.5,
        commit_ms=1.0,
        finalize_ms=0.2,
        launch_ms=0.3,
        tick_wall_ms=2.0,
        tick_cpu_ms=1.5,
        gc_ms=0.0,
    )
    row.update(kw)
    return row


def test_gaps_run_between_steps_with_decode_rows_and_carry_their_parts() -> None:
    ms = 1e-3
    trace = [
        _row(0.0, forward_start_ms=0.0, forward_ms=2.0, sample_start_ms=2.0, sample_ms=0.1),
        _row(2 * ms, forward_start_ms=2.1, forward_ms=2.0, sample_start_ms=4.1, sample_ms=0.1),
        # Held rows only: no decode rows, so no gap ends here (its time still counts).
        _row(3 * ms, kind="mixed", decode_rows=0, forward_start_ms=4.2, forward_ms=0.5),
        _row(
            9 * ms,
            kind="mixed",
            prefill=True,
            forward_start_ms=7.0,
            forward_ms=2.5,
            sample_start_ms=9.5,
            sample_ms=0.1,
        ),
    ]
    rows = step_gaps.gap_rows(trace, {"A": (0.0, 1.0)})
    assert [round(r["gap_ms"], 6) for r in rows] == [2.0, 7.0]
    assert rows[0]["bubble_ms"] == pytest.approx(0.0)
    # The forward began 2.3 ms after the held-rows step's forward ended.
    assert rows[1]["bubble_ms"] == pytest.approx(2.3)
    assert rows[1]["host_ms"] == pytest.approx(1.5) and rows[1]["prefill"] is True


def test_the_summary_splits_phases_and_names_the_slow_tail() -> None:
    ms = 1e-3
    trace, t = [], 0.0
    for i in range(400):  # phase A: steady 2 ms gaps
        t += 2 * ms
        trace.append(_row(t, step=i))
    b0 = t + ms / 2
    for i in range(400):  # phase B: every 50th gap is a 6 ms mixed step beside a prefix
        slow = i % 50 == 0
        t += (6 if slow else 2.5) * ms
        trace.append(_row(t, kind="mixed" if slow else "decode", prefill=slow))
    out = step_gaps.analyse(trace, {"A": (0.0, b0), "B": (b0, t + 1)})
    a, b = out["A"], out["B"]
    assert a["p50_ms"] == pytest.approx(2.0) and a["p99_over_a_p50"] == pytest.approx(1.0)
    assert b["p99_ms"] == pytest.approx(6.0) and b["p99_over_a_p50"] == pytest.approx(3.0)
    assert b["tail"]["mixed_share"] == 1.0 and b["tail"]["prefill_share"] == 1.0
    assert b["by_kind"]["decode/idle"]["gap_p99_ms"] == pytest.approx(2.5)
    assert b["gaps"] + a["gaps"] == len(trace) - 1


@pytest.mark.gpu
def test_on_cuda_every_step_carries_its_device_times(
    tiny_dir: Path, sample_image: PreparedImage, tmp_path: Path
) -> None:
    path = tmp_path / "steps.json"
    config = local_config(model=str(tiny_dir), device="cuda", dtype="bf16", step_trace=str(path))
    requests = [
        GenerationRequest(Task.CAPTION, sample_image, max_tokens=12, temperature=0)
        for _ in range(3)
    ]
    _serve(batched_engine(config), requests)
    rows = step_trace.load(path)
    timed = [r for r in rows if r["forward_ms"] is not None]
    assert len(timed) >= len(rows) - 1  # a step of held rows only may run no forward
    assert all(r["forward_ms"] > 0 and r["forward_start_ms"] >= 0 for r in timed)
    starts = [r["forward_start_ms"] for r in timed]
    assert starts == sorted(starts)  # one compute stream: forwards in launch order
    assert any(r["sample_ms"] is not None and r["sample_ms"] > 0 for r in rows)


def test_a_served_engine_says_where_its_start_up_went(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = local_config(model=str(tiny_dir), device="cpu", dtype="fp32")
    with caplog.at_level("INFO", logger="vlm_server.server.engines"):
        batched_engine(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert len(lines) == 1, caplog.text
    seconds = [float(v) for v in re.findall(r"(\d+\.\d) s", lines[0])]
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
