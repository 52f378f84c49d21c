"""CPU smoke tests of the benchmarks: each runs in a tiny configuration and writes
well-formed results (the GPU numbers themselves come from bench/run_gpu_suite.sh)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench import (
    arrival_itl,
    arrival_timeline,
    hf_baseline,
    host_tick,
    image_bench,
    load_gen,
    request_timeline,
)
from bench.synth_images import parse_size, unique_images, with_orientation
from image_pipeline import ResizeMode, decode, prepare_image, sample_image_bytes

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _strict_json(path: Path) -> Any:
    """Parsed JSON; NaN or Infinity (not JSON) fail the test."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{path.name} holds {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _ordered(row: dict[str, Any], prefix: str) -> None:
    p50, p90, p99 = (row[f"{prefix}_p{q}_ms"] for q in (50, 90, 99))
    assert 0 <= p50 <= p90 <= p99, (prefix, p50, p90, p99)


def test_percentile_and_schedule() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert load_gen.percentile(xs, 50) == 3.0
    assert load_gen.percentile(xs, 0) == 1.0 and load_gen.percentile(xs, 100) == 5.0
    assert load_gen.percentile([1.0, 2.0], 50) == 1.5
    arrivals = load_gen.poisson_schedule(rate=100.0, max_requests=50, duration=10.0, seed=1)
    assert len(arrivals) == 50 and arrivals == sorted(arrivals)
    short = load_gen.poisson_schedule(rate=10.0, max_requests=10_000, duration=2.0, seed=1)
    assert 1 <= len(short) < 100 and short[-1] <= 2.0
    known = load_gen.workloads(64)
    sc = load_gen.parse_scenario("detect5:64x48:repeated:c1,c8,r2.5", known, ())
    assert (sc.size, sc.mode, sc.workload.max_objects) == ((64, 48), "repeated", 5)
    assert [lv.label for lv in sc.levels] == ["c=1", "c=8", "r=2.5/s"]
    with pytest.raises(ValueError):
        load_gen.parse_scenario("query3:64x48:unique:x4", known, ())


def test_loop_lag_quantiles_from_histogram_growth() -> None:
    inf = float("inf")
    before = {0.001: 10.0, 0.01: 10.0, 0.1: 10.0, inf: 10.0}
    after = {0.001: 60.0, 0.01: 100.0, 0.1: 109.0, inf: 110.0}  # 50 / 40 / 9 / 1 new samples
    lag = load_gen.loop_lag_summary(before, after)
    assert lag["loop_lag_samples"] == 100
    assert lag["loop_lag_p50_ms"] == pytest.approx(1.0)  # the 50th sample ends bucket one
    assert lag["loop_lag_p99_ms"] == pytest.approx(100.0)
    assert load_gen.histogram_quantile(0.995, after) == 0.1  # in +Inf: its lower bound
    assert math.isnan(load_gen.histogram_quantile(0.5, {0.1: 0.0, inf: 0.0}))
    assert load_gen.loop_lag_summary(None, after)["loop_lag_p99_ms"] is None


def test_unique_images_differ_after_decoding() -> None:
    w, h = parse_size("400x300")
    images = unique_images(w, h, [0, 1, 2], threads=2)
    assert len({prepare_image(b).content_hash for b in images}) == 3


def test_load_gen_spawned_server(tiny_dir: Path, tmp_path: Path) -> None:
    code = load_gen.main(
        [
            "--spawn",
            "--scenario",
            "query3:64x48:unique:c1,c2",
            "--scenario",
            "query3:64x48:repeated:c1",
            "--scenario",
            "detect5:64x48::c2,r20",
            "--requests",
            "3",
            "--duration",
            "30",
            "--warmup",
            "1",
            "--slo-ms",
            "60000",
            "--quiet",
            "--out",
            str(tmp_path),
            "--",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0
    data = _strict_json(tmp_path / "load_gen.json")
    assert data["complete"] and data["server_exit_code"] == 0
    assert data["device"] == "cpu" and data["model"]["preset"] == "tiny"
    rows = {(r["scenario"], r["level"]): r for r in data["rows"]}
    assert list(rows) == [
        ("query3/64x48/unique", "c=1"),
        ("query3/64x48/unique", "c=2"),
        ("query3/64x48/repeated", "c=1"),
        ("detect5/64x48/unique", "c=2"),
        ("detect5/64x48/unique", "r=20/s"),
    ]
    for (_, level), r in rows.items():
        expected = 3 if level != "r=20/s" else r["requests"]
        assert r["requests"] == expected and r["ok"] == expected and not r["errors"]
        assert 1 <= r["requests"] <= 3
        _ordered(r, "e2e")
        _ordered(r, "ttft")
        assert r["ttft_p50_ms"] <= r["e2e_p50_ms"]
        assert r["req_per_s"] > 0 and r["goodput_req_per_s"] == pytest.approx(r["req_per_s"])
    query = rows[("query3/64x48/unique", "c=1")]
    assert 1 <= query["output_tokens_max"] <= 3  # max_tokens 3; actual count reported
    assert query["tokens_per_s"] > 0
    _ordered(query, "itl")
    # Unary RPCs: the first "token" is the whole answer.
    detect = rows[("detect5/64x48/unique", "c=2")]
    assert detect["ttft_p50_ms"] == detect["e2e_p50_ms"] and detect["itl_p50_ms"] is None
    # One repeated picture hits the prefix cache; unique ones never do.
    assert (
        rows[("query3/64x48/repeated", "c=1")]["cached_tokens_mean"] > query["cached_tokens_mean"]
    )
    # The spawned server's metrics port is known: each level carries its loop-lag summary.
    assert data["metrics_url"] and all(r["loop_lag_samples"] >= 0 for r in rows.values())
    assert (tmp_path / "load_gen_server.log").exists()
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "load_gen_latency.png").stat().st_size > 0
        assert (tmp_path / "load_gen_throughput.png").stat().st_size > 0


@pytest.mark.slow  # a second spawned server (test_load_gen_spawned_server stays): --run-slow
def test_load_gen_compares_the_http_and_grpc_doors(tiny_dir: Path, tmp_path: Path) -> None:
    code = load_gen.main(
        [
            "--spawn",
            "--doors",
            "grpc",
            "http",
            "--scenario",
            "query3:64x48:repeated:c4",
            "--scenario",
            "detect5:64x48:unique:c2",
            "--requests",
            "4",
            "--warmup",
            "1",
            "--slo-ms",
            "60000",
            "--quiet",
            "--out",
            str(tmp_path),
            "--",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0
    data = _strict_json(tmp_path / "load_gen.json")
    assert data["complete"] and data["server_exit_code"] == 0 and data["http_url"]
    rows = {(r["scenario"], r["door"]): r for r in data["rows"]}
    assert list(rows) == [
        ("query3/64x48/repeated", "grpc"),
        ("query3/64x48/repeated", "http"),
        ("detect5/64x48/unique", "grpc"),
        ("detect5/64x48/unique", "http"),
    ]
    for r in rows.values():
        assert r["ok"] == r["requests"] == 4 and not r["errors"], r
        _ordered(r, "e2e")
        assert r["server_total_p50_ms"] > 0  # the server's metrics came back over both doors
    query = rows[("query3/64x48/repeated", "http")]
    assert 1 <= query["output_tokens_max"] <= 3 and query["cached_tokens_mean"] > 0
    assert query["ttft_p50_ms"] <= query["e2e_p50_ms"]
    # The same picture and settings through either door: the same answers' lengths.
    grpc_query = rows[("query3/64x48/repeated", "grpc")]
    assert query["output_tokens_total"] == grpc_query["output_tokens_total"]


def test_arrival_itl_counts_each_gap_in_the_phase_it_ends() -> None:
    tl = arrival_timeline.Timeline(start=0.0, warmup_end=1.0, a_end=3.0, b_end=5.0)
    assert [tl.phase(t) for t in (0.5, 1.0, 2.9, 3.0, 4.9, 5.0)] == [
        None,
        "A",
        "A",
        "B",
        "B",
        None,
    ]
    rec = load_gen.Record(True, streamed=True, ttft_s=0.5, e2e_s=0.9, gaps_s=[0.1, 0.2])
    assert arrival_timeline.stream_deltas(rec, 10.0) == pytest.approx([10.5, 10.6, 10.8])
    assert arrival_timeline.stream_deltas(load_gen.Record(False), 10.0) == []


@pytest.mark.slow  # two spawned servers and client processes: run with --run-slow
@pytest.mark.parametrize("processes", [1, 2])
def test_arrival_itl_spawned_server(tiny_dir: Path, tmp_path: Path, processes: int) -> None:
    """In one client process and with the streams spread over two (gaps measured there, on
    the same clock, come back and land in the phase they ended in); the two-process run's
    server has its engine in a process of its own, whose events' delay is read too."""
    engine_process = "on" if processes == 2 else "off"
    code = arrival_itl.main(
        [
            "--spawn",
            "--client-processes",
            str(processes),
            "--streams",
            "2",
            "--rate",
            "2",
            "--duration",
            "2",
            "--warmup",
            "1",
            "--warmup-arrivals",
            "1",
            "--size",
            "64x48",
            "--caption-tokens",
            "32",
            "--quiet",
            "--out",
            str(tmp_path),
            "--",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--engine-process",
            engine_process,
        ]
    )
    assert code == 0
    data = _strict_json(tmp_path / "arrival_itl.json")
    assert data["complete"] and data["server_exit_code"] == 0 and data["device"] == "cpu"
    # Results name no machine's folders (the checkpoint and the output folder were absolute).
    assert str(tmp_path) not in json.dumps(data) and str(tiny_dir) not in json.dumps(data)
    samples = 0
    for phase in ("A", "B"):
        r = data["phases"][phase]
        assert r["gaps"] > 0 and r["streams_with_gaps"] == 2 and not r["stream_errors"], r
        _ordered(r, "itl")
        assert r["itl_p99_ms"] <= r["itl_p99.9_ms"] <= r["itl_max_ms"]
        assert 1 <= r["output_tokens_min"] <= r["output_tokens_max"] <= 32  # max_tokens 32
        assert r["tokens_per_delta"] > 0
        assert r["client_loop_lag_p99_ms"] >= 0  # every process's loop sampled its lag
        samples += r["server_step_samples"]
        # The server's own step intervals over the phase: steps counted, percentiles ordered.
        assert r["server_steps"] > 0
        assert 0 < r["server_itl_p50_ms"] <= r["server_itl_p90_ms"] <= r["server_itl_p99_ms"]
        if engine_process == "on":  # the delivery share: engine process to the streams
            assert 0 < r["events_delay_p50_ms"] <= r["events_delay_p99_ms"]
        else:
            assert r["events_delay_p50_ms"] is None and r["events_delay_p99_ms"] is None
        cdf = data["gap_cdf_ms"][phase]
        assert [q for q, _ in cdf] == sorted({q for q, _ in cdf})
        assert [ms for _, ms in cdf] == sorted(ms for _, ms in cdf)
    assert data["metrics_url"] and samples > 0  # the step gauge was found and read
    arrivals = data["arrivals"]
    assert arrivals["requests"] >= 1 and arrivals["ok"] == arrivals["requests"]
    assert arrivals["offered_req_per_s"] > 0 and arrivals["achieved_req_per_s"] > 0
    assert 1 <= arrivals["output_tokens_max"] <= 3
    _ordered(arrivals, "e2e")
    verdict = data["verdict"]
    assert verdict["decode_period_ms"] == data["phases"]["A"]["itl_p50_ms"]
    assert verdict["ratio_b_p99_over_a_p50"] > 0 and verdict["target_ratio"] == 2.0
    assert verdict["server_ratio_b_p99_over_a_p50"] > 0
    a_server = data["phases"]["A"]
    spread = a_server["server_itl_p99_ms"] / a_server["server_itl_p50_ms"]
    assert verdict["server_idle_spread"] == pytest.approx(spread)
    assert isinstance(verdict["meets_target"], bool)
    assert (tmp_path / "arrival_itl_server.log").exists()
    assert (tmp_path / "arrival_itl.png").exists() == HAVE_MATPLOTLIB


def test_with_orientation_turns_the_decoded_picture() -> None:
    (data,) = unique_images(64, 48, [0], threads=1)
    decoded = decode(with_orientation(data, 6))
    assert (decoded.width, decoded.height) == (48, 64)
    np.testing.assert_array_equal(decoded.pixels, decode(data).pixels.transpose(1, 0, 2)[:, ::-1])


def test_image_bench_tiny(tmp_path: Path) -> None:
    code = image_bench.main(
        [
            "--sizes",
            "64x48",
            "--formats",
            "jpeg",
            "png",
            "--threads",
            "1",
            "2",
            "--images",
            "2",
            "--min-seconds",
            "0.02",
            "--min-calls",
            "1",
            "--resize",
            "vips",
            "pillow",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = _strict_json(tmp_path / "image_bench.json")
    assert [(r["format"], r["resize"], r["threads"]) for r in data["rows"]] == [
        (fmt, mode, threads)
        for fmt in ("jpeg", "png")
        for mode in ("vips", "pillow")
        for threads in (1, 2)
    ]
    for r in data["rows"]:
        assert r["calls"] >= r["threads"] and r["images_per_s"] > 0
        assert 0 < r["prepare_ms"] <= r["ms_per_image"] and r["normalize_ms"] >= 0
        assert r["cpu_ms"] > 0 and r["gpu_ms"] is None and r["sm_ms"] is None  # CPU only
        assert r["crops"] >= 1
        assert r["gpu_decode"] is False and r["decode_cpu_ms"] > 0
        assert r["split"] is False and r["engine_cpu_ms"] is None
    assert data["gpu_decode_min_pixels"] == 0


def test_kernel_busy_time_is_the_union_of_intervals() -> None:
    """sm ms counts overlapping kernels once and the gaps between them not at all."""
    assert image_bench.busy_us([]) == 0
    assert image_bench.busy_us([(0, 10)]) == 10
    assert image_bench.busy_us([(20, 30), (0, 10)]) == 20  # a gap of 10 is not counted
    assert image_bench.busy_us([(0, 10), (5, 15), (6, 8)]) == 15  # overlaps once
    assert image_bench.busy_us([(0, 10), (10, 12)]) == 12


def test_image_bench_split_path() -> None:
    """The engine-process path: the server's share and the engine's, timed apart."""
    images = unique_images(96, 64, range(2), fmt="jpeg")
    args = (images, 1, 0.0, 1, None, torch.float32, ResizeMode.VIPS, "cpu")
    cell = image_bench.run_cell(*args, split=True)
    assert cell["split"] is True and cell["cpu_ms"] > 0 and cell["engine_cpu_ms"] > 0
    assert cell["crops"] >= 1 and cell["gpu_ms"] is None
    # With GPU decode, the server's share stops at the header and the key; the engine's
    # process decodes (here a stand-in decoder on the CPU).
    calls: list[int] = []

    def stand_in(data: bytes, device: torch.device) -> torch.Tensor:
        calls.append(len(data))
        return torch.from_numpy(decode(data).pixels).permute(2, 0, 1)

    both = image_bench.run_cell(*args, split=True, gpu_decode_min_pixels=1, gpu_decoder=stand_in)
    assert both["split"] is True and both["gpu_decode"] is True
    assert both["cpu_ms"] > 0 and both["engine_cpu_ms"] > 0 and both["crops"] == cell["crops"]
    assert len(calls) == both["calls"] + 1  # the warm-up and every timed call


def test_image_bench_gpu_decode_option(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []

    def stand_in(data: bytes, device: torch.device) -> torch.Tensor:
        calls.append(len(data))
        return torch.from_numpy(decode(data).pixels).permute(2, 0, 1)

    images = unique_images(96, 64, range(2), fmt="jpeg")
    args = (images, 1, 0.0, 1, None, torch.float32, ResizeMode.VIPS, "cpu")
    cell = image_bench.run_cell(*args, gpu_decode_min_pixels=96 * 64, gpu_decoder=stand_in)
    assert cell["gpu_decode"] is True and cell["decode_cpu_ms"] is None and cell["cpu_ms"] > 0
    assert len(calls) == cell["calls"] + 1  # the warm-up and every timed call
    host = image_bench.run_cell(*args, gpu_decode_min_pixels=96 * 64 + 1, gpu_decoder=stand_in)
    assert host["gpu_decode"] is False and host["decode_cpu_ms"] > 0
    assert len(calls) == cell["calls"] + 1
    # Asked for where it cannot run: refused, not measured on the host path.
    with pytest.raises(SystemExit) as caught:
        image_bench.main(["--gpu-decode-min-pixels", "1", "--device", "cpu"])
    assert caught.value.code == 2
    assert "--gpu-decode-min-pixels needs --device cuda" in capsys.readouterr().err


def test_hf_baseline_tiny(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    code = hf_baseline.main(
        [
            "--tiny",
            "--batches",
            "1",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--cb-requests",
            "2",
            "--cb-tokens",
            "4",
            "--cb-runs",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = _strict_json(tmp_path / "hf_baseline.json")
    for mode in ("dynamic", "static"):
        (row,) = data[mode]
        assert "error" not in row, row
        assert row["batch"] == 1 and row["new_tokens"] == 5
        assert row["ms_per_token"] > 0 and row["tokens_per_s"] > 0
    batch = data["batch"]
    assert batch["status"] in ("ok", "unavailable")
    if batch["status"] == "ok":
        assert batch["generated_tokens"] == 2 * 4 and batch["tokens_per_s"] > 0


@pytest.mark.slow  # a timed soak: run with --run-slow
def test_soak_against_a_running_server_counts_codes_and_samples_memory(
    tiny: Any, tmp_path: Path
) -> None:
    from bench import soak
    from tests.support.service_harness import ServerThread, in_process, local_config
    from vlm_server.engine.config import EngineConfig
    from vlm_server.engine.engine import BatchedEngine

    pictures = soak.Pictures(96, 64)
    assert len({prepare_image(pictures.take()).content_hash for _ in range(12)}) == 12
    config = EngineConfig(max_batch_size=8, kv_budget_bytes=16 << 20)
    with ServerThread(local_config(), in_process(lambda: BatchedEngine(tiny, config))) as server:
        code = soak.main(
            [
                "--target",
                server.target,
                "--metrics-url",
                server.metrics_url,
                "--duration",
                "3",
                "--concurrency",
                "4",
                "--image-size",
                "96x64",
                "--storm-every",
                "1",
                "--storm-size",
                "4",
                "--settle",
                "0.5",
                "--out",
                str(tmp_path),
            ]
        )
    assert code == 0
    result = _strict_json(tmp_path / "soak.json")
    summary = result["summary"]
    assert summary["requests"] > 0 and summary["unclean"] == 0
    assert summary["codes"]["storm"] == {"CANCELLED": summary["codes"]["storm"]["CANCELLED"]}
    assert summary["rss_mib"]["peak"] > 0 and summary["kv_pages_total"] > 0
    assert len(result["samples"]) >= 3
    assert (tmp_path / "soak_rss.png").exists() == HAVE_MATPLOTLIB


def test_host_tick_runs_the_runtime_of_this_tree_on_its_scripted_device() -> None:
    """One short case a family (the slow test below runs them all): the scripted device still
    offers everything the runtime reads, and segments end and are replaced."""
    image = prepare_image(sample_image_bytes())
    row = host_tick.run_case(host_tick._model({}, "segment"), "segment", 2, 140, image)
    assert row["completed"] >= 2 and row["tick_p99_us"] >= row["tick_us"] > 0
    row = host_tick.run_case(host_tick._model({}, "text"), "text", 2, 5, image)
    assert row["completed"] == 0 and row["rows"] == 2


@pytest.mark.slow  # every scenario, then two worker processes: run with --run-slow
def test_host_tick_every_scenario_and_a_comparison(tmp_path: Path) -> None:
    args = ["--rows", "1", "3", "--ticks", "10", "--repeat", "1", "--out", str(tmp_path)]
    assert host_tick.main([*args, "--events", "batched"]) == 0
    data = _strict_json(tmp_path / "host_tick.json")
    assert [(r["scenario"], r["rows"]) for r in data["rows"]] == [
        (s, n) for s in host_tick.SCENARIOS for n in (1, 3)
    ]
    for r in data["rows"]:
        assert 0 < r["commit_us"] + r["finalize_us"] + r["launch_us"] <= r["tick_mean_us"] * 3
    # This tree against itself, in two worker processes.
    compare = ["--baseline", str(host_tick.ROOT), "--scenarios", "region", "--label", "ab"]
    assert host_tick.main([*args, *compare]) == 0
    rows = _strict_json(tmp_path / "host_tick_ab.json")["rows"]
    assert [r["rows"] for r in rows] == [1, 3] and all(r["ratio"] > 0 for r in rows)


def kernel(ts: float, dur: float, stream: int, name: str) -> dict[str, Any]:
    """A profiler trace's kernel event."""
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name,
            "args": {"stream": stream}}  # fmt: skip


def test_request_timeline_gpu_view_sums_streams_and_finds_gaps() -> None:
    trace = {
        "traceEvents": [
            kernel(100, 50, 7, "a"),
            kernel(120, 60, 9, "b"),  # overlaps a: busy counts the union
            kernel(400, 10, 7, "c"),  # 220 us after b ends: a gap
            kernel(420, 5, 7, "d"),  # 10 us: jitter, not a gap
            {"ph": "X", "cat": "cuda_runtime", "ts": 90, "dur": 3, "name": "cudaGraphLaunch"},
        ]
    }
    view = request_timeline.gpu_view(trace, (90.0, 500.0))
    assert view["kernel_us_per_stream"] == {"stream 7": 65.0, "stream 9": 60.0}
    assert view["gpu_busy_us"] == 80.0 + 10.0 + 5.0
    assert [(g["gap_us"], g["after"], g["before"]) for g in view["gaps"]] == [(220.0, "b", "c")]
    assert view["first_kernel_at_us"] == 10.0
    assert view["runtime_calls"] == {"cudaGraphLaunch": 1}


def test_request_timeline_tiny_on_the_cpu(tmp_path: Path) -> None:
    args = ["--preset", "tiny", "--device", "cpu", "--size", "160x120", "--requests", "2"]
    args += ["--warmup", "1", "--profile", "1", "--out", str(tmp_path)]
    assert request_timeline.main(args) == 0
    result = _strict_json(tmp_path / "request_timeline.json")
    assert len(result["timed"]) == 2 and len(result["profiled"]) == 1
    p50 = result["timed_p50"]
    assert 0 < p50["decode_ms"] < p50["total_ms"]
    assert p50["engine_ttft_ms"] <= p50["total_ms"]


def test_request_timeline_stream_view_merges_each_streams_kernels() -> None:
    trace = {
        "traceEvents": [
            kernel(100, 50, 7, "a"),
            kernel(130, 40, 7, "b"),  # overlaps a on its own stream: busy is the union
            kernel(300, 10, 7, "c"),  # 130 us idle on stream 7
            kernel(120, 60, 9, "d"),
            kernel(900, 5, 9, "late"),  # outside the window
        ]
    }
    view = request_timeline.stream_view(trace, (100.0, 500.0))
    assert view["7"]["kernels"] == 3 and view["7"]["kernel_us"] == 100.0
    assert view["7"]["busy_us"] == 80.0 and view["7"]["idle_us"] == 130.0
    assert view["7"]["longest_gaps"] == [(130.0, "c")]
    assert view["7"]["top_kernels"] == [("a", 50.0, 1), ("b", 40.0, 1), ("c", 10.0, 1)]
    assert view["9"] == {
        "kernels": 1, "kernel_us": 60.0, "busy_us": 60.0, "idle_us": 0.0, "longest_gaps": [],
        "top_kernels": [("d", 60.0, 1)],
    }  # fmt: skip


def test_request_timeline_saturated_tiny_on_the_cpu(tmp_path: Path) -> None:
    args = ["--preset", "tiny", "--device", "cpu", "--size", "160x120", "--concurrency", "2"]
    # The window lasts until a request completed in it: progress, not speed (a fixed
    # 300 ms window saw none on a busy 2-core machine).
    args += ["--warmup-s", "0.2", "--window-ms", "300", "--window-requests", "1"]
    args += ["--out", str(tmp_path)]
    assert request_timeline.main(args) == 0
    sat = _strict_json(tmp_path / "saturated_timeline.json")["saturated"]
    assert sat["concurrency"] == 2 and sat["completed"] > 0 and sat["req_per_s"] > 0


@pytest.mark.slow
def test_bulk_bench_runs_its_three_phases(tiny_dir: Path, tmp_path: Path) -> None:
    """vlm batch against the online server, then queries under a Batch API job: every phase
    ends with its figures, and the rows bench.targets reads come out of them."""
    from bench import bulk_bench

    sizes = ["--pictures", "12", "--online-requests", "12", "--batch-requests", "60"]
    server = ["--device", "cpu", "--dtype", "fp32", "--max-batch-size", "4"]
    code = bulk_bench.main(
        ["--model", str(tiny_dir), *sizes, "--queries", "4", "--out", str(tmp_path), "--", *server]
    )
    assert code == 0
    data = json.loads((tmp_path / "bulk_bench.json").read_text())
    assert data["offline"]["lines"] == 12 and data["offline"]["failed"] == 0
    assert data["online"]["tok_s"] > 0 and data["mixed"]["busy_p50_ms"] > 0
    assert data["mixed"]["busy_server_prefix_wait_ms_p50"] >= 0
    names = {r["name"] for r in bulk_bench.rows(data, "tiny", "abc1234")}
    assert "tiny.query3.under_batch.p50_ratio" in names
    assert "tiny.batch.caption128.online_ratio" in names
