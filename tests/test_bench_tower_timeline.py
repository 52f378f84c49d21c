"""The tower timeline's summary (CPU): kernel kinds, per-replay times and idle time by pair."""

from __future__ import annotations

import pytest

from bench.tower_timeline import kind_of, summarize


def _replay(t0: float) -> list[dict]:
    # memset 1 us, idle 3, product 50, idle 1, attention 80, idle 2, norm 20
    return [
        {"name": "Memset (Device)", "ts": t0, "dur": 1.0},
        {"name": "nvjet_sm90_tst_128x232_bias_TNT", "ts": t0 + 4, "dur": 50.0},
        {"name": "cudnn_generated_fort_native_sdpa_sm90", "ts": t0 + 55, "dur": 80.0},
        {"name": "_add_layernorm_kernel", "ts": t0 + 137, "dur": 20.0},
    ]


def test_kinds_by_name() -> None:
    assert kind_of("nvjet_sm90_tst_256x144_gelubias") == "cuBLAS product"
    assert kind_of("Memset (Device)") == "memset"
    assert kind_of("_add_layernorm_kernel") == "add + LayerNorm"
    assert kind_of("cudnn_generated_fort_native_sdpa") == "cuDNN attention"
    assert kind_of("x" * 50) == "x" * 40


def test_summary_per_replay_with_the_idle_time_between_replays() -> None:
    # Two replays 10 us apart, given out of order.
    events = _replay(167.0) + _replay(0.0)
    out = summarize(events, replays=2)
    assert out["kernels_per_replay"] == 4
    assert out["busy_us"] == pytest.approx(151.0)
    assert out["span_us"] == pytest.approx((167 + 157) / 2)
    assert out["idle_us"] == pytest.approx(out["span_us"] - 151.0)
    kinds = out["kinds"]
    assert next(iter(kinds)) == "cuDNN attention"  # the largest total first
    assert kinds["cuBLAS product"] == {"count": 1, "us": 50.0, "median_us": 50.0}
    gaps = out["gaps"]
    assert gaps["memset -> cuBLAS product"]["us"] == pytest.approx(3.0)
    assert gaps["cuBLAS product -> cuDNN attention"]["us"] == pytest.approx(1.0)
    assert gaps["add + LayerNorm -> memset"]["count"] == 0.5  # only between the two replays
    assert gaps["add + LayerNorm -> memset"]["median_us"] == pytest.approx(10.0)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="replays"):
        summarize(_replay(0.0), replays=0)
    with pytest.raises(ValueError, match="no kernel events"):
        summarize([], replays=1)
