"""CPU smoke test of bench/loop_lag.py: small bodies over both doors of a tiny in-process
server; the results are well formed (the figures themselves come from a full run)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import loop_lag
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=2, kv_budget_bytes=16 << 20)
    factory = in_process(lambda: BatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


def test_loop_lag_bench_writes_json_plot_and_table(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--target", server.target, "--http-url", server.http_url, "--out", str(tmp_path)]
    args += ["--body-mb", "1.5", "--rounds", "1", "--idle", "0.3", "--gap", "0.05"]
    assert loop_lag.main(args) == 0
    result = json.loads((tmp_path / "loop_lag.json").read_text())
    doors = {row["door"]: row for row in result["doors"]}
    assert set(doors) == {"grpc", "http"}
    assert doors["grpc"]["codes"] == ["INVALID_ARGUMENT"] and doors["http"]["codes"] == ["400"]
    assert all(row["bodies"] == 1 for row in doors.values())
    assert [w["door"] for w in result["windows"]] == ["grpc", "http"]
    assert {kind for _, kind, _ in result["probes"]} == {"grpc", "http"}
    assert "| grpc | 1 |" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loop_lag.png").stat().st_size > 0
