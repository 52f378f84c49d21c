"""A graph's replays kernel by kernel (bench/kernel_timeline.py) from made-up profiler traces:
kinds, replays told apart by their launches, busy and idle time, medians."""

from __future__ import annotations

import pytest

from bench.kernel_timeline import Kernel, kind_of, replay_stats, replays_of_trace, summarize


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}


def _launch(ts: float, name: str = "cudaGraphLaunch") -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 3}


def test_kinds_name_the_projects_kernels() -> None:
    assert kind_of("_up_kernel") == "experts fc1"
    assert kind_of("_up_reduce_kernel") == "experts fc1"
    assert kind_of("_down_kernel") == "experts fc2"
    assert kind_of("_paged_decode_kernel") == "attention"
    assert kind_of("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "cuBLAS products"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copies"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert kind_of("_add_layernorm_kernel") == "norms"
    assert kind_of("x" * 50) == "x" * 40  # an unknown kernel keeps its name


def test_each_launch_owns_the_kernels_up_to_the_next() -> None:
    trace = {
        "traceEvents": [
            _kernel("_route_kernel", 5, 2),  # before any launch: not a replay's
            _launch(10),
            _kernel("_up_kernel", 20, 10),
            _kernel("_down_kernel", 34, 6),
            _launch(100, "cudaGraphLaunch_v10000"),
            _kernel("_down_kernel", 125, 5),
            _kernel("_up_kernel", 110, 10),
            _kernel("Memset (Device)", 131, 1, cat="gpu_memset"),
            {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 112, "dur": 4},
        ]
    }
    replays = replays_of_trace(trace)
    assert [[k.name for k in r] for r in replays] == [
        ["_up_kernel", "_down_kernel"],
        ["_up_kernel", "_down_kernel", "Memset (Device)"],
    ]
    # No launch calls in the trace: the launches' correlation ids group the kernels.
    by_id = [_kernel("_up_kernel", 50, 1), _kernel("_down_kernel", 52, 1)]
    by_id.append(_kernel("_up_kernel", 9, 1))
    for e, corr in zip(by_id, (8, 8, 3), strict=True):
        e["args"]["correlation"] = corr
    assert [[k.start for k in r] for r in replays_of_trace({"traceEvents": by_id})] == [
        [9],
        [50, 52],
    ]


def test_a_replays_idle_time_is_its_gaps_and_overlaps_are_busy() -> None:
    kernels = [
        Kernel("_up_kernel", 0, 10),
        Kernel("_paged_decode_kernel", 4, 10),  # overlaps the first: no gap, union busy
        Kernel("_down_kernel", 20, 5),  # 6 idle after the attention
        Kernel("_combine_kernel", 27, 3),  # 2 idle after fc2
    ]
    s = replay_stats(kernels)
    assert s["span_us"] == 30 and s["busy_us"] == 22 and s["idle_us"] == 8
    assert s["idle_at"] == {
        "attention -> experts fc2": 6,
        "experts fc2 -> combines (experts, attention splits)": 2,
    }
    assert s["kinds"]["experts fc1"] == {"count": 1, "us": 10}
    assert s["kernels"] == 4


def test_the_summary_takes_medians_and_a_missing_kind_counts_zero() -> None:
    a = [Kernel("_up_kernel", 0, 10), Kernel("_down_kernel", 12, 4)]
    b = [Kernel("_up_kernel", 0, 12), Kernel("_down_kernel", 14, 4)]
    c = [Kernel("_up_kernel", 0, 11), Kernel("_route_kernel", 11, 1), Kernel("_down_kernel", 15, 4)]
    s = summarize([a, b, c])
    assert s["replays"] == 3 and s["span_us"] == 18
    assert s["kinds"]["experts fc1"]["us"] == 11
    assert s["kinds"]["expert routing"] == {"count": 0, "us": 0.0}
    assert next(iter(s["idle_at"])) == "experts fc1 -> experts fc2"
    with pytest.raises(ValueError, match="no replay"):
        summarize([])
