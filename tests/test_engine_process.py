"""The engine in a process of its own (``--engine-process on``): the wire, the host that
serves the pipe in the engine process, and a server whose engine runs in a child process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from image_pipeline import PreparedImage, sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.service_harness import ServerThread, local_config, module_server, wait_for
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import VisionLanguageClient, VlmError
from vlm_server.engine.api import (
    EngineError,
    EngineStats,
    ErrorCode,
    Finished,
    FinishReason,
    GenerationRequest,
    Task,
    TextDelta,
)
from vlm_server.engine.intake import Intake, Route, Ticket
from vlm_server.engine.process.client import ProcessEngine
from vlm_server.engine.process.shared_pixels import (
    PixelPool,
    share,
    shared_array,
    shared_fd,
    shared_map,
    take_released,
)
from vlm_server.engine.process.wire import (
    Accepted,
    Cancel,
    Close,
    Events,
    Refused,
    Sender,
    Stats,
    Submit,
    dumps,
    loads,
    recv,
)
from vlm_server.engine.process.worker import EngineHost, PipeOutbox
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.rpc.servicer import SERVICE_NAME
from vlm_server.server import engines
from vlm_server.server.engines import engine_factory, uses_engine_process

KV_BUDGET = 16 << 20
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---- the wire -----------------------------------------------------------------------------


def test_engine_errors_cross_with_code_message_and_field() -> None:
    data, shared = dumps(EngineError(ErrorCode.INVALID_ARGUMENT, "bad pattern", "regex"))
    assert shared == []
    err = loads(data, [])
    assert isinstance(err, EngineError)
    assert (err.code, err.message, err.field) == (
        ErrorCode.INVALID_ARGUMENT,
        "bad pattern",
        "regex",
    )


def test_a_request_with_cpu_crops_crosses_by_value(sample_image: PreparedImage) -> None:
    request = GenerationRequest(Task.CAPTION, sample_image, request_id="r1", deadline=12.5)
    data, shared = dumps(Submit(7, request))
    assert shared == []
    got = loads(data, [])
    assert got.rid == 7 and got.request.request_id == "r1" and got.request.deadline == 12.5
    assert torch.equal(got.request.image.crops, sample_image.crops)
    assert got.request.image.content_hash == sample_image.content_hash


def _open_fds() -> set[str]:
    # A set, compared by what it gains: descriptors of earlier tests (a process's pipes
    # closed by a collection) may close meanwhile.
    return set(os.listdir("/proc/self/fd"))


def test_shared_pixels_cross_as_descriptors_and_leak_none() -> None:
    pixels = shared_array((6, 5, 3))
    pixels[...] = np.arange(90, dtype=np.uint8).reshape(6, 5, 3)
    plain = np.full((2, 2, 3), 7, np.uint8)
    commands_in, commands_out = _pipe()
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    before = _open_fds()
    sender = Sender(commands_out, here)
    for _ in range(3):
        sender.send((pixels, plain, pixels[1:]))
        got, got_plain, got_part = recv(commands_in, there)
        assert np.array_equal(got, pixels) and not got.flags.writeable
        assert np.array_equal(got_plain, plain) and np.array_equal(got_part, pixels[1:])
        pixels[0, 0, 0] = 200  # one memory: the receiver sees the sender's writes
        assert got[0, 0, 0] == 200
        del got, got_plain, got_part
    gc.collect()
    assert not _open_fds() - before
    with pytest.raises(ValueError, match="cannot send"):
        Sender(commands_out).send(pixels)  # a channel without a descriptor socket
    assert shared_fd(share(plain)) is not None and share(pixels) is pixels
    assert shared_fd(pixels[1:]) is None  # only whole arrays cross by descriptor


def test_pool_reuses_a_buffer_once_neither_side_holds_it() -> None:
    pool = PixelPool(max_free_bytes=3 * 90)
    first = pool.array((6, 5, 3))
    first_id = shared_map(first).buffer_id  # type: ignore[union-attr]
    pool.sent(first_id)  # the engine process maps it
    del first
    gc.collect()
    second = pool.array((6, 5, 3))  # the engine still holds the first: a new buffer
    assert shared_map(second).buffer_id != first_id and pool.reused == 0  # type: ignore[union-attr]
    pool.released([first_id])
    third = pool.array((6, 5, 3))
    assert shared_map(third).buffer_id == first_id and pool.reused == 1  # type: ignore[union-attr]
    other = pool.array((2, 5, 3))  # another size never takes it
    assert shared_map(other).buffer_id not in (first_id,)  # type: ignore[union-attr]
    kept = [pool.array((6, 5, 3)) for _ in range(5)]
    del second, third, other, kept
    gc.collect()
    assert pool.stats()[1] <= 3 * 90  # free buffers beyond the bound are unmapped


def test_an_array_dying_while_the_pool_is_locked_does_not_deadlock() -> None:
    """A collection can run inside any allocation, in a thread holding the pool's lock:
    the array's death must not need that lock."""
    pool = PixelPool()
    cycle: list[object] = [pool.array((3, 3, 3))]
    cycle.append(cycle)  # only a collection frees it
    first_id = shared_map(cycle[0]).buffer_id  # type: ignore[arg-type, union-attr]
    del cycle
    died = threading.Event()

    def die_under_the_lock() -> None:
        with pool._lock:
            gc.collect()  # the array above dies here
            died.set()

    worker = threading.Thread(target=die_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert died.is_set(), "the array's death waited for the pool's lock"
    reused = pool.array((3, 3, 3))
    assert shared_map(reused).buffer_id == first_id  # type: ignore[union-attr]


def test_received_buffers_are_reported_released_once_dropped() -> None:
    pool = PixelPool()
    pixels = pool.array((4, 4, 3))
    pixels[...] = 9
    buffer_id = shared_map(pixels).buffer_id  # type: ignore[union-attr]
    commands_in, commands_out = _pipe()
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    take_released()
    sender = Sender(commands_out, here)
    sender.send(pixels)
    sender.send(pixels)  # two messages: two mappings there
    received = [recv(commands_in, there), recv(commands_in, there)]
    assert [int(a.sum()) for a in received] == [9 * 48, 9 * 48]
    del pixels
    gc.collect()
    assert pool.array((4, 4, 3)) is not None and pool.reused == 0  # still mapped there
    del received
    gc.collect()
    released = take_released()
    assert released == [buffer_id, buffer_id]
    pool.released(released)
    gc.collect()
    assert shared_map(pool.array((4, 4, 3))).buffer_id == buffer_id  # type: ignore[union-attr]


def test_engine_process_is_on_for_cuda_models_only_when_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not uses_engine_process(local_config(device="cpu"))
    assert uses_engine_process(local_config(device="cpu", engine_process="on"))
    monkeypatch.setattr(engines, "resolve_device", lambda name: torch.device("cuda"))
    assert uses_engine_process(local_config(engine_process="auto"))
    assert not uses_engine_process(local_config(engine_process="off"))
    # GPU decode goes with an engine process: its process decodes the JPEGs left encoded.
    assert uses_engine_process(local_config(image_gpu_decode_min_pixels=4_000_000))
    assert uses_engine_process(
        local_config(engine_process="on", image_gpu_decode_min_pixels=4_000_000)
    )


# ---- the host, with a stand-in engine ------------------------------------------------------


class _Seq:
    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.emit: Any = None
        self.cancelled = False
        self.released = False

    def release_resources(self) -> None:
        self.released = True


class _StandInEngine:
    """The engine's real intake (engine/intake.py) around a stand-in: builds instantly, or
    waits on ``hold`` for requests with a regex; emits one delta and a result once queued
    unless the question is "run"."""

    def __init__(self, max_decoding: int = 256) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.building = threading.Event()
        self.admitted: dict[str, _Seq] = {}
        self.built: dict[str, _Seq] = {}
        self.compiles_stopped: list[str] = []
        self.closed = False
        self.intake: Intake[_Seq] = Intake(self, max_decoding)

    def admit(self, request: GenerationRequest, route: Route) -> Ticket[_Seq]:
        return self.intake.admit(request, route)

    def check_open(self) -> None:
        pass

    def decode_image(self, request: GenerationRequest) -> GenerationRequest:
        return request

    def stop_compiling(self, request: GenerationRequest) -> None:
        self.compiles_stopped.append(request.request_id)

    def build(self, request: GenerationRequest) -> _Seq:
        if request.question == "refuse":
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "no", "question")
        if request.question == "crash":
            raise RuntimeError("a bug")
        if request.regex is not None:
            self.building.set()
            assert self.hold.wait(10)
        seq = _Seq(request)
        self.built[request.request_id] = seq
        return seq

    def queue(self, seq: _Seq, emit: Any) -> None:
        seq.emit = emit
        self.admitted[seq.request.request_id] = seq
        if seq.request.question != "run":
            emit(TextDelta("hi"))
            emit(Finished(FinishReason.EOS, text="hi"))

    def cancel(self, seq: _Seq) -> None:
        seq.cancelled = True

    def stats(self) -> EngineStats:
        return EngineStats(
            active_sequences=len(self.admitted), images_decoding=self.intake.decoding
        )

    def close(self) -> None:
        self.intake.close()
        self.closed = True


def _pipe() -> tuple[Connection, Connection]:
    read, write = os.pipe()
    return Connection(read, writable=False), Connection(write, readable=False)


@pytest.fixture
def host() -> Iterator[tuple[_StandInEngine, PipeOutbox, Sender, Connection, threading.Thread]]:
    with served_host(_StandInEngine()) as served:
        yield served


@contextlib.contextmanager
def served_host(
    engine: _StandInEngine,
) -> Iterator[tuple[_StandInEngine, PipeOutbox, Sender, Connection, threading.Thread]]:
    """An `EngineHost` serving ``engine`` on a thread: (engine, its outbox, the command
    sender, the events pipe's reading end, the thread); closed on exit."""
    commands_in, commands_out = _pipe()
    events_in, events_out = _pipe()
    sender = Sender(events_out)
    outbox = PipeOutbox(sender)
    served = EngineHost(engine, sender, outbox)  # type: ignore[arg-type]
    thread = threading.Thread(target=served.serve, args=(commands_in,), daemon=True)
    thread.start()
    yield engine, outbox, Sender(commands_out), events_in, thread
    engine.hold.set()
    Sender(commands_out).send(Close())
    thread.join(10)


def _next(events: Connection, kind: type) -> Any:
    """The next message of ``kind`` (the host also sends its stats every so often)."""
    while True:
        assert events.poll(10), f"no {kind.__name__} came"
        message = recv(events)
        if isinstance(message, kind):
            return message
        assert isinstance(message, Stats), message


def _request(rid: str, question: str = "q", regex: str | None = None) -> GenerationRequest:
    return GenerationRequest(Task.QUERY, None, request_id=rid, question=question, regex=regex)


def test_host_accepts_refuses_and_sends_a_ticks_events_in_one_message(host: Any) -> None:
    _, outbox, commands, events, _ = host
    commands.send(Submit(1, _request("a")))
    assert _next(events, Accepted).rid == 1
    outbox.flush()  # what the scheduler does once per tick
    assert _next(events, Events).items == [
        (1, TextDelta("hi")),
        (1, Finished(FinishReason.EOS, text="hi")),
    ]
    commands.send(Submit(2, _request("b", "refuse")))
    refused = _next(events, Refused)
    assert refused.rid == 2 and refused.error.field == "question"
    commands.send(Submit(3, _request("c", "crash")))
    refused = _next(events, Refused)
    assert refused.error.code is ErrorCode.INTERNAL and "a bug" in refused.error.message
    assert _next(events, Stats).stats.active_sequences == 1


def test_a_request_cancelled_while_its_constraint_builds_is_never_queued(host: Any) -> None:
    """Its compile is told to stop; once built, what it took is released and it is refused
    as cancelled (the server's caller is gone: nobody reads it)."""
    engine, _, commands, events, _ = host
    engine.hold.clear()
    commands.send(Submit(1, _request("slow", "run", regex="a+")))
    assert engine.building.wait(10)
    commands.send(Cancel(1))
    commands.send(Submit(2, _request("fast", "run")))  # the pipe is not blocked meanwhile
    assert _next(events, Accepted).rid == 2
    wait_for(lambda: engine.compiles_stopped == ["slow"], what="the compile to be stopped")
    engine.hold.set()
    refused = _next(events, Refused)
    assert refused.rid == 1 and refused.error.code is ErrorCode.CANCELLED
    assert "slow" not in engine.admitted and engine.built["slow"].released
    assert not engine.admitted["fast"].cancelled


def test_host_survives_an_unreadable_command(host: Any) -> None:
    _, _, commands, events, thread = host
    commands.conn.send_bytes(b"\0not a pickle")
    commands.send(Submit(1, _request("after")))
    assert _next(events, Accepted).rid == 1 and thread.is_alive()


def test_host_cancels_running_requests_and_stops_on_close(host: Any) -> None:
    engine, _, commands, events, thread = host
    commands.send(Submit(1, _request("r", "run")))
    assert _next(events, Accepted).rid == 1
    commands.send(Cancel(1))
    commands.send(Cancel(99))  # unknown or ended: ignored
    wait_for(lambda: engine.admitted["r"].cancelled, what="the cancel to apply")
    commands.send(Close())
    thread.join(10)
    assert not thread.is_alive() and engine.closed


# ---- a server whose engine runs in a child process ----------------------------------------


def _config(tiny_dir: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model": str(tiny_dir),
        "device": "cpu",
        "dtype": "fp32",
        "kv_budget_bytes": KV_BUDGET,
        "max_batch_size": 4,
        "engine_process": "on",
    }
    return local_config(**{**values, **overrides})


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    config = _config(tiny_dir, http_port=-1)
    with ServerThread(config, engine_factory(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[VisionLanguageClient]:
    with VisionLanguageClient(server.target, timeout=60) as c:
        yield c


def _engine(server: ServerThread) -> ProcessEngine:
    assert server.server is not None
    engine = server.server.core.engine
    assert isinstance(engine, ProcessEngine)
    return engine


def test_streams_and_results_equal_the_reference(
    client: VisionLanguageClient, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    events = list(client.caption_stream(sample_image_bytes(), temperature=0.0, max_tokens=24))
    want = generator.caption(sample_image, "normal", SamplingSettings(0.0, max_tokens=24))
    assert "".join(e.text for e in events[:-1]) == events[-1].text == want.text
    boxes = client.detect(sample_image_bytes(), "house", max_objects=3)
    want_boxes = generator.detect(sample_image, "house", max_objects=3)
    assert [(b.x_min, b.y_min, b.x_max, b.y_max) for b in boxes.boxes] == [
        (b.x_min, b.y_min, b.x_max, b.y_max) for b in want_boxes.boxes
    ]
    answer = client.query(sample_image_bytes(), "which?", choices=["red", "blue"])
    assert answer.text in ("red", "blue")


def test_the_http_door_serves_through_the_engine_process(
    server: ServerThread, generator: ReferenceGenerator, sample_image: PreparedImage
) -> None:
    body = {
        "image_url": data_url(sample_image_bytes()),
        "question": "what is it?",
        "settings": {"temperature": 0, "max_tokens": 6},
    }
    status, answer = post_json(f"{server.http_url}/query", body)
    assert status == 200
    want = generator.query(sample_image, "what is it?", SamplingSettings(0.0, max_tokens=6))
    assert answer["answer"] == want.text


def test_the_engine_process_reports_its_garbage_collections(server: ServerThread) -> None:
    """The engine's own collections stall its scheduler: the server exports them apart."""

    def engine_gen0() -> float:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (
                    sample.name == "vlm_engine_gc_pause_seconds_count"
                    and sample.labels.get("generation") == "0"
                ):
                    return sample.value
        raise AssertionError("no vlm_engine_gc_pause_seconds in the metrics")

    with VisionLanguageClient(server.target, timeout=60) as c:
        c.caption(sample_image_bytes(), max_tokens=8)
    wait_for(lambda: engine_gen0() > 0, what="the engine's collections to be reported")


def test_the_delay_of_the_engine_processs_events_is_exported(server: ServerThread) -> None:
    """Each tick's events carry when they were sent; the server exports how long they took
    to reach its streams."""

    def delays() -> tuple[float, float]:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("vlm_engine_events_delay_seconds_"):
                    found[sample.name.rsplit("_", 1)[1]] = sample.value
        return found.get("count", 0.0), found.get("sum", 0.0)

    before, _ = delays()
    with VisionLanguageClient(server.target, timeout=60) as c:
        pieces = list(c.caption_stream(sample_image_bytes(), temperature=0.0, max_tokens=12))
    wait_for(lambda: delays()[0] >= before + 1, what="the events' delays to be observed")
    count, total = delays()
    # At least one message per tick that carried a token; each well under a second.
    assert count - before >= 1 and len(pieces) >= 2
    assert 0.0 <= total / count < 1.0


def test_refusals_from_the_engine_process_name_the_field(client: VisionLanguageClient) -> None:
    with pytest.raises(VlmError) as caught:
        client.query(None, "q", regex="(unclosed")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.field == "regex"


def _long_caption() -> pb.CaptionRequest:
    """A caption that streams for many steps."""
    return pb.CaptionRequest(
        image_bytes=sample_image_bytes(),
        settings=pb.GenerationSettings(temperature=0, max_tokens=1000),
    )


def _settled_pages(engine: object, reports: int = 5) -> int:
    """KV pages in use once nothing runs and the count held still over ``reports`` successive
    stats reports of the engine process (each made after its scheduler ran again): a
    finished sequence still in flight (a zombie) is not counted as active, yet holds its
    pages until its last step commits. Counted in reports, not seconds: a busy machine
    slows the reports down, never the check."""
    seen: list[int] = []
    last = None

    def settled() -> bool:
        nonlocal last
        s = engine.stats()  # type: ignore[attr-defined]
        if s is last:
            return False  # no new report yet
        last = s
        seen.append(s.kv_pages_in_use if s.active_sequences == 0 else -1)
        tail = seen[-reports:]
        return len(tail) == reports and len(set(tail)) == 1 and tail[0] > 0

    wait_for(settled, interval=0.01, what="the engine's page count to settle")
    return seen[-1]


def test_a_cancelled_stream_frees_its_pages_in_the_engine_process(server: ServerThread) -> None:
    engine = _engine(server)
    with VisionLanguageClient(server.target, timeout=60) as c:
        c.caption(sample_image_bytes(), max_tokens=2)  # the image prefix is cached from here
    cached = _settled_pages(engine)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        call = stub.Caption(_long_caption(), timeout=60)
        assert [next(call).WhichOneof("event") for _ in range(3)] == ["delta"] * 3
        wait_for(lambda: engine.stats().kv_pages_in_use > cached, what="its pages in use")
        call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    wait_for(
        lambda: (s := engine.stats()).active_sequences == 0 and s.kv_pages_in_use == cached,
        what="its pages to be freed",
    )
    assert not engine._streams  # nothing left waiting for events


@pytest.fixture(scope="module", autouse=True)
def _server_to_kill_the_engine_of(
    request: pytest.FixtureRequest, tiny_dir: Path
) -> Iterator[ServerThread | None]:
    """The dead-engine test's own server (no other test uses it), started with the module
    when that test is in the run: its engine process loads while the tests before it run."""
    yield from module_server(
        request,
        "test_a_dead_engine_process_fails_its_requests_and_health",
        lambda: _config(tiny_dir),
    )


def test_a_dead_engine_process_fails_its_requests_and_health(
    _server_to_kill_the_engine_of: ServerThread | None,
) -> None:
    running = _server_to_kill_the_engine_of
    assert running is not None and running.server is not None
    running.run(running.server.wait_ready())
    try:
        engine = _engine(running)
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            request = _long_caption()
            call = stub.Caption(request, timeout=60)
            assert next(call).WhichOneof("event") == "delta"
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Caption(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service)).status

            wait_for(lambda: status(SERVICE_NAME) == NOT_SERVING, what="readiness to go")
            assert status("") == NOT_SERVING  # liveness too: restart the server
    finally:
        running.stop()


def _never_ready() -> None:
    time.sleep(120)  # a model that takes longer to load than the server waits


def test_stopping_while_the_engine_loads_ends_its_process() -> None:
    engine = ProcessEngine(_never_ready)

    async def start_then_stop() -> None:
        starting = asyncio.ensure_future(engine.start())
        deadline = time.monotonic() + 60  # only a broken run waits this long
        while engine.pid is None:  # the process is started: it loads from now on
            assert time.monotonic() < deadline, "the engine process never started"
            await asyncio.sleep(0.01)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(start_then_stop())
    assert engine._process is not None and engine._process.poll() is not None


def test_an_engine_process_that_cannot_load_fails_the_start(tmp_path: Path) -> None:
    engine = engine_factory(_config(tmp_path / "missing"))()
    assert isinstance(engine, ProcessEngine)

    async def start() -> None:
        await engine.start()

    with pytest.raises(RuntimeError, match="failed to start"):
        asyncio.run(start())


@pytest.mark.gpu
def test_the_engine_process_crops_on_the_gpu_and_answers_as_in_process(tiny_dir: Path) -> None:
    """Host-decoded pixels through shared memory, cropped by the engine process on the GPU:
    its greedy answers equal those of the same engine in the server's process, which crops
    on the GPU itself."""
    answers = {}
    for mode in ("off", "on"):
        config = _config(tiny_dir, device="cuda", engine_process=mode)
        with (
            ServerThread(config, engine_factory(config)) as running,
            VisionLanguageClient(running.target, timeout=120) as c,
        ):
            if mode == "on":
                assert isinstance(_engine(running), ProcessEngine)
            answers[mode] = [
                c.caption(sample_image_bytes(), temperature=0.0, max_tokens=16).text,
                [(b.x_min, b.y_min) for b in c.detect(sample_image_bytes(), "house").boxes],
            ]
    assert answers["on"] == answers["off"]
