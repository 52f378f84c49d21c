"""Every call reaches the request metrics and the access log with its real status code:
expired deadlines are DEADLINE_EXCEEDED (not CANCELLED), also for calls that end before their
request was read (the deadline passed while it was still arriving); and
a stalled event loop shows in the loop-lag histogram."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.engine.config import EngineConfig
from vlm_server.frontend.logs import ACCESS_LOGGER
from vlm_server.frontend.metrics import ServiceMetrics
from vlm_server.models.interface import LoadedModel


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    with ServerThread(
        local_config(),
        in_process(lambda: GatedBatchedEngine(tiny, EngineConfig(kv_budget_bytes=16 << 20))),
    ) as running:
        yield running


def _requests_total(server: ServerThread) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.labels["task"], s.labels["code"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vlm_requests_total"
    }


def _access(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == ACCESS_LOGGER]  # type: ignore[attr-defined]


def test_a_deadline_that_passes_while_running_is_deadline_exceeded(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    assert server.server is not None
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    before = _requests_total(server).get(("query", "DEADLINE_EXCEEDED"), 0)
    request = pb.QueryRequest(
        question="a long story", settings=pb.GenerationSettings(temperature=0, max_tokens=400)
    )
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    engine.token_gate.clear()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            call = stub.Query(request, timeout=1.0, metadata=(("x-request-id", "slowpoke"),))
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        engine.token_gate.set()
    line = wait_for(
        lambda: [f for f in _access(caplog) if f.get("request_id") == "slowpoke"],
        what="the access-log line",
    )[0]
    assert line["code"] == "DEADLINE_EXCEEDED"
    after = _requests_total(server).get(("query", "DEADLINE_EXCEEDED"), 0)
    assert after == before + 1


def test_a_call_that_expires_before_its_request_arrives_is_counted(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The client opens the call but its message never comes: gRPC ends the call at the
    deadline without running the handler."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    before = _requests_total(server).get(("point", "DEADLINE_EXCEEDED"), 0)
    release = threading.Event()

    def never() -> Iterator[bytes]:
        release.wait(30)
        return
        yield b""  # a generator that sends nothing until released

    with grpc.insecure_channel(server.target) as channel:
        send = channel.stream_unary("/vlm.v1.VisionLanguage/Point")
        with pytest.raises(grpc.RpcError) as caught:
            send(never(), timeout=0.5)
        release.set()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(
        lambda: _requests_total(server).get(("point", "DEADLINE_EXCEEDED"), 0) == before + 1,
        what="the call to be counted",
    )
    line = next(f for f in _access(caplog) if f.get("stage") == "receiving")
    assert line["code"] == "DEADLINE_EXCEEDED" and line["request_id"]


def test_a_storm_of_short_deadlines_is_logged_as_deadline_exceeded(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """200 calls with deadlines of 1 to 50 ms while the engine is held: every call the
    server sees is logged once, and as DEADLINE_EXCEEDED, whether it expired while running,
    queued, or still arriving. (A call that expires before gRPC hands it to the server, or
    before it leaves the client, is invisible to the server and cannot be logged.)"""
    assert server.server is not None
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    before = _requests_total(server)
    request = pb.QueryRequest(question="hello", settings=pb.GenerationSettings(max_tokens=50))
    codes: list[grpc.StatusCode] = []
    rng = random.Random(0)
    deadlines = [rng.uniform(0.001, 0.05) for _ in range(200)]
    engine.token_gate.clear()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)

            def one(i: int) -> None:
                rid = (("x-request-id", f"storm-{i}"),)
                try:
                    list(stub.Query(request, timeout=deadlines[i], metadata=rid))
                except grpc.RpcError as err:
                    codes.append(err.code())  # type: ignore[attr-defined]

            threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    finally:
        engine.token_gate.set()
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 200
    wait_for(lambda: server.server is not None and not server.server.core.in_flight.count)

    def queries() -> list[dict[str, Any]]:
        # Every query of this test is one of the storm's (one whose metadata was never read
        # is logged under an id of the server's).
        return [f for f in _access(caplog) if f.get("task") == "query"]

    def grew() -> dict[str, float]:
        after = _requests_total(server)
        return {
            code: after.get(("query", code), 0) - before.get(("query", code), 0)
            for code in ("DEADLINE_EXCEEDED", "CANCELLED", "OK")
        }

    def agreeing() -> tuple[list[dict[str, Any]], dict[str, float]] | None:
        # One look at both: the log's lines, then the counters, kept only when they agree.
        lines, counts = queries(), grew()
        return (lines, counts) if sum(counts.values()) == len(lines) else None

    # A call that never reached its handler is recorded when the transport ends it, which
    # can come after the clients returned (and go on a while on a loaded machine): the
    # checks hold for a moment when the log and the counters agree, whatever comes later.
    lines, counts = wait_for(agreeing, what="the log and the counters to agree")
    assert lines, "the server saw none of the calls"
    assert {f["code"] for f in lines} == {"DEADLINE_EXCEEDED"}
    storm = [f["request_id"] for f in lines if str(f["request_id"]).startswith("storm-")]
    assert len(set(storm)) == len(storm)  # each logged once
    assert counts == {"DEADLINE_EXCEEDED": len(lines), "CANCELLED": 0, "OK": 0}


def _loop_lag(server: ServerThread) -> tuple[float, float]:
    """(observations, observations above 0.1 s) of the server's event-loop lag histogram."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vlm_event_loop_lag_seconds")
    }
    count = samples[("vlm_event_loop_lag_seconds_count", None)]
    return count, count - samples[("vlm_event_loop_lag_seconds_bucket", "0.1")]


def test_a_blocked_event_loop_shows_in_the_loop_lag_histogram(server: ServerThread) -> None:
    count, slow = _loop_lag(server)

    async def block() -> None:
        time.sleep(0.25)  # holds the loop: the lag sampler wakes >= 0.2 s late

    server.run(block())
    # The sampler sleeps 50 ms at a time, so it was due at most that long into the block.
    after = wait_for(
        lambda: (lag := _loop_lag(server))[1] > slow and lag, what="a late wake-up recorded"
    )
    assert after[0] > count


def test_the_loop_lag_sampler_records_how_late_it_wakes_and_stops() -> None:
    metrics = ServiceMetrics()

    async def main() -> None:
        metrics.watch_loop(interval=0.01)
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the sampler was due at most 10 ms into this
        await asyncio.sleep(0.05)
        await metrics.unwatch_loop()

    asyncio.run(main())
    get = metrics.registry.get_sample_value
    count = get("vlm_event_loop_lag_seconds_count")
    assert count is not None and count >= 3
    assert (get("vlm_event_loop_lag_seconds_sum") or 0.0) >= 0.19
    assert (get("vlm_event_loop_lag_seconds_bucket", {"le": "0.1"}) or 0.0) <= count - 1
    assert metrics._lag_task is None


def test_garbage_collections_are_counted_by_generation_while_watched() -> None:
    metrics = ServiceMetrics()

    def count(generation: int) -> float:
        value = metrics.registry.get_sample_value(
            "vlm_gc_pause_seconds_count", {"generation": str(generation)}
        )
        return value or 0.0

    async def main() -> None:
        metrics.watch_loop(interval=0.01)
        gc.collect()
        gc.collect(0)
        await metrics.unwatch_loop()

    asyncio.run(main())
    full, young = count(2), count(0)
    assert full >= 1 and young >= 1
    assert (
        metrics.registry.get_sample_value("vlm_gc_pause_seconds_sum", {"generation": "2"}) or 0.0
    ) > 0
    gc.collect()  # not watched any more: nothing recorded
    assert count(2) == full


def test_a_client_that_hangs_up_after_its_answer_is_counted_ok(server: ServerThread) -> None:
    """The gRPC clients cancel a stream once they have its result; whether that cancel beats
    the handler's own end is a race, and either way the request succeeded."""
    from vlm_server.client import VisionLanguageClient

    before = _requests_total(server)
    with VisionLanguageClient(server.target, timeout=60) as client:
        for _ in range(10):
            client.query(None, "hi", temperature=0, max_tokens=2)

    def grown() -> dict[str, float]:
        after = _requests_total(server)
        return {
            code: after.get(("query", code), 0) - before.get(("query", code), 0)
            for code in ("OK", "CANCELLED")
        }

    wait_for(lambda: grown()["OK"] + grown()["CANCELLED"] >= 10, what="the calls counted")
    assert grown() == {"OK": 10, "CANCELLED": 0}
