"""Start, readiness, drain and SIGTERM; reflection; the Prometheus endpoint.

The subprocess server runs its default engine (batched); in-process servers run both engines.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from image_pipeline import PreparedImage, sample_image_bytes
from tests.support import early
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    in_process,
    local_config,
    wait_for,
)
from tests.support.spawned_server import SpawnedServer, key
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import TextResult, VisionLanguageClient, VlmError
from vlm_server.engine.api import Engine
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.rpc.servicer import SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
KV_BUDGET = 16 << 20  # the batched engine's cache in these tests (its default is 256 MiB)


def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _not_ready(target: str) -> bool:
    try:
        return _health(target, SERVICE_NAME) == NOT_SERVING
    except grpc.RpcError:
        return True  # already gone


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


# ---- start and drain ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [2, 1])
def test_readiness_is_off_while_loading_and_during_drain(tiny: LoadedModel, depth: int) -> None:
    engines: list[GatedBatchedEngine] = []

    def factory() -> GatedBatchedEngine:
        config = EngineConfig(kv_budget_bytes=KV_BUDGET, pipeline_depth=depth)
        engine = GatedBatchedEngine(tiny, config)
        engine.start_gate.clear()
        engines.append(engine)
        return engine

    server = ServerThread(local_config(), in_process(factory)).start(wait_ready=False)
    try:
        target = server.target
        wait_for(lambda: engines, what="the engine to be created")
        engine = engines[0]
        assert _health(target, "") == SERVING  # alive while loading
        assert _health(target, SERVICE_NAME) == NOT_SERVING
        with VisionLanguageClient(target, timeout=10) as client:
            with pytest.raises(VlmError) as caught:
                client.query(None, "are you there?")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert "loading" in caught.value.message
            engine.start_gate.set()
            wait_for(lambda: _health(target, SERVICE_NAME) == SERVING, what="readiness")

            engine.token_gate.clear()
            stream = client.query_stream(None, "a long answer please", temperature=0, max_tokens=24)
            reader = concurrent.futures.ThreadPoolExecutor(1)
            first = reader.submit(lambda: list(stream))
            reader.shutdown(wait=False)
            wait_for(engine.holding.is_set, what="the request to run")
            drained = server.submit(server.server.shutdown(30))  # type: ignore[union-attr]
            wait_for(lambda: _health(target, SERVICE_NAME) == NOT_SERVING, what="draining")
            assert _health(target, "") == SERVING  # still alive while draining
            with pytest.raises(VlmError) as caught:
                client.query(None, "one more?")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert "draining" in caught.value.message
            engine.token_gate.set()
            events = first.result(60)
            drained.result(60)
        if isinstance(engine, GatedBatchedEngine):
            wait_for(engine.idle, what="an idle engine")
            assert engine.scheduler.pages.used_pages == 0  # a text-only request: no prefix
        final = events[-1]
        assert isinstance(final, TextResult) and final.finish_reason in ("eos", "length")
        assert "".join(e.text for e in events[:-1]) == final.text
    finally:
        for engine in engines:
            engine.start_gate.set()
            engine.token_gate.set()
        server.stop()


def _read_ports(proc: subprocess.Popen[str], lines: list[str]) -> tuple[int, int]:
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"msg=listening grpc_port=(\d+) metrics_port=(\d+)", line)
        if match:
            return int(match.group(1)), int(match.group(2))
    raise AssertionError("server exited before listening:\n" + "".join(lines))


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_sigterm_finishes_accepted_requests_then_exits_0(
    tiny_dir: Path,
    generator: ReferenceGenerator,
    sample_image: PreparedImage,
    engine_process: str,
) -> None:
    # Most often started with the test run: loading takes seconds (see tests.support.early).
    proc = early.take(key(engine_process), lambda: SpawnedServer(tiny_dir, engine_process)).proc
    lines: list[str] = []
    try:
        port, _ = _read_ports(proc, lines)
        drain_log = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
        drain_log.start()
        target = f"127.0.0.1:{port}"
        wait_for(lambda: _health(target, SERVICE_NAME) == SERVING, timeout=60, what="ready")
        # Long answers (about 3 s of decode on two busy cores, 0.3 s at 120 tokens) so that
        # the signal lands while they run: the drain below must have work to finish.
        n, max_tokens = 3, 1000
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            request = pb.CaptionRequest(
                image_bytes=sample_image_bytes(),
                settings=pb.GenerationSettings(temperature=0, max_tokens=max_tokens),
            )
            calls = [stub.Caption(request, timeout=120) for _ in range(n)]
            # Every request runs (a delta streamed), with most of its steps to go.
            firsts = [next(call) for call in calls]
            # To the whole group, as systemd or a terminal's Ctrl-C would: an engine process
            # must keep running until the server has drained.
            os.killpg(proc.pid, signal.SIGTERM)
            wait_for(lambda: _not_ready(target), what="the signal to take effect")
            with pytest.raises(grpc.RpcError) as caught:  # new work is refused
                list(stub.Caption(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            results = [[first, *call] for first, call in zip(firsts, calls, strict=True)]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    want = generator.caption(
        sample_image, "normal", SamplingSettings(temperature=0, max_tokens=max_tokens)
    )
    for messages in results:
        assert messages[-1].result.text == want.text
        assert "".join(m.delta.text for m in messages[:-1]) == want.text
    log = "".join(lines)
    assert "msg=config" in log and "grace_period=60.000" in log  # the environment was read
    assert " engine=batched " in log  # the default engine
    draining = re.search(r"msg=draining .*in_flight=(\d+)", log)
    assert draining and int(draining.group(1)) >= 1, log  # the drain had work to finish
    assert "msg=stopped" in log
    assert log.count("msg=request") >= n and "code=OK" in log


# ---- reflection and metrics ---------------------------------------------------------------


def _engine_factory(tiny: LoadedModel) -> Callable[[], Engine]:
    return in_process(lambda: BatchedEngine(tiny, EngineConfig(kv_budget_bytes=KV_BUDGET)))


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    with ServerThread(local_config(), _engine_factory(tiny)) as running:
        yield running


def test_reflection_lists_and_describes_the_service(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="vlm.v1.VisionLanguage"),
        ]
        listing, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listing.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and b"vlm/v1/vision_language.proto" in files[0]


def test_metrics_endpoint_counts_requests_and_reads_engine_gauges(server: ServerThread) -> None:
    with VisionLanguageClient(server.target, timeout=60) as client:
        for _ in range(2):
            client.query(None, "hello?", temperature=0, max_tokens=3)
        with pytest.raises(VlmError):
            client.query(None, "hello?", temperature=-1)
    samples = _scrape(server.metrics_url)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    grpc_query = {"door": "grpc", "task": "query"}
    assert value("vlm_requests_total", **grpc_query, code="OK") == 2
    assert value("vlm_requests_total", **grpc_query, code="INVALID_ARGUMENT") == 1
    assert value("vlm_requests_received_total", **grpc_query) == 3
    assert value("vlm_time_to_first_token_seconds_count", **grpc_query) == 2
    assert value("vlm_request_duration_seconds_count", **grpc_query) == 3
    assert value("vlm_output_tokens_total", **grpc_query) > 0
    for gauge in (
        "vlm_queue_depth",
        "vlm_active_sequences",
        "vlm_images_decoding",
        "vlm_kv_pages_in_use",
        "vlm_batch_size",
        "vlm_step_period_ms",
        "vlm_prefix_cache_hit_ratio",
    ):
        assert (gauge, ()) in samples, gauge
    assert value("vlm_queue_depth") == 0 and value("vlm_requests_in_flight", door="grpc") == 0


def test_two_servers_in_one_process_keep_separate_metrics(
    server: ServerThread, tiny: LoadedModel
) -> None:
    with ServerThread(local_config(), _engine_factory(tiny)) as other:
        with VisionLanguageClient(other.target, timeout=60) as client:
            client.model_info()
        samples = _scrape(other.metrics_url)
    ok = (("code", "OK"), ("door", "grpc"))
    assert samples[("vlm_requests_total", (*ok, ("task", "model_info")))] == 1
    assert ("vlm_requests_total", (*ok, ("task", "query"))) not in samples
