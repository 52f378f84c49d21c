"""The cluster on a local Ray instance: two CPU replicas of the tiny model behind both kinds of
doors at once, the gateway (``--ingress gateway``, the default) and Ray Serve's gRPC and HTTP
proxies (``--ingress ray``), shared by the module's tests (starting it is most of their time).

Every RPC and HTTP route through each door; image affinity read from the replicas' own
metrics; a replica killed while it streams; drain. Assertions follow order and progress
(a stream has begun, a replica was replaced), never wall-clock windows; the timeouts below
only keep a broken run from hanging."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

import ray
from PIL import Image
from ray import serve
from ray.serve._private import api as serve_api

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, events, post, post_json
from tests.support.ray_patience import patient_proxies
from vlm_server.client import TextDelta, TextResult, VisionLanguageClient
from vlm_server.client.security import Security
from vlm_server.client.types import VlmError
from vlm_server.cluster.app import APP_NAME, SERVICER, application
from vlm_server.cluster.directory import directory, metrics_endpoints
from vlm_server.cluster.gateway import Gateway
from vlm_server.cluster.metrics import scrape_all, value
from vlm_server.options.cluster import ClusterConfig
from vlm_server.options.table import ServerConfig

# Only a broken run waits this long: a replica restart took over 120 s on two loaded cores.
HANG_GUARD_S = 300.0
BODY_LIMIT = 2 << 20
KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_TOKENS = 700  # a stream of seconds on the tiny model (within its context)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _picture(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (96, 64), ((seed * 37) % 256, (seed * 91) % 256, 128)).save(out, "JPEG")
    return out.getvalue()


class Door:
    """One way in: a gRPC target and an HTTP base URL."""

    def __init__(self, name: str, grpc_port: int, http_port: int) -> None:
        self.name = name
        self.target = f"127.0.0.1:{grpc_port}"
        self.url = f"http://127.0.0.1:{http_port}"

    def client(self, key: str | None = KEY) -> VisionLanguageClient:
        return VisionLanguageClient(
            self.target, timeout=HANG_GUARD_S, security=Security(api_key=key)
        )


class GatewayThread:
    """The gateway as ``vlm cluster`` runs it, on an event loop of its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        entry = directory(APP_NAME)

        async def entries() -> dict[str, Any]:
            return await entry.replicas.remote()

        self.gateway = Gateway(entries, 1.25, 64 << 20, BODY_LIMIT, refresh_s=0.25)
        self.call(self.gateway.start("127.0.0.1", 0, -1))
        self.call(self.gateway.wait_ready(2))

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_GUARD_S)


class Cluster:
    def __init__(self, grpc_port: int, http_port: int, gateway: GatewayThread) -> None:
        self.gateway = gateway
        self.doors = (
            Door("gateway", gateway.gateway.port, gateway.gateway.http_port),
            Door("ray", grpc_port, http_port),
        )

    def metrics(self) -> dict[str, str]:
        return scrape_all(metrics_endpoints(APP_NAME))


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    grpc_port, http_port = _free_port(), _free_port()
    # Ray gives its proxies a fixed minute to come up; on two busy cores they took longer, so
    # the wait is bounded only loosely here (a proxy that never starts still fails the test).
    saved_timeout = serve_api.HTTP_PROXY_TIMEOUT
    serve_api.HTTP_PROXY_TIMEOUT = 600
    with patient_proxies():  # the controller and proxies read it when Ray starts them
        ray.init(num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER]},
        )
        server = ServerConfig(
            model=str(tiny_dir),
            device="cpu",
            dtype="fp32",
            grace_period=60,
            max_http_body_bytes=BODY_LIMIT,
            api_keys=(KEY,),  # checked by each replica's server, as by one server alone
        )
        replicas = ClusterConfig(
            replicas=2, gpus_per_replica=0, cpus_per_replica=0.5, replica_host="127.0.0.1"
        )
        serve.run(application(replicas, server), name=APP_NAME, route_prefix="/")
        gateway = GatewayThread()
        yield Cluster(grpc_port, http_port, gateway)
        gateway.call(gateway.gateway.stop(5))
    finally:
        serve.shutdown()
        ray.shutdown()
        serve_api.HTTP_PROXY_TIMEOUT = saved_timeout


@pytest.mark.parametrize("door", [0, 1], ids=["gateway", "ray"])
def test_every_rpc_through_the_door(cluster: Cluster, door: int) -> None:
    image = sample_image_bytes()
    way_in = cluster.doors[door]
    with way_in.client() as client:
        info = client.model_info()
        assert info.max_batch_size > 0
        stream = list(client.caption_stream(image, "short", max_tokens=8))
        assert isinstance(stream[-1], TextResult) and stream[-1].metrics.output_tokens > 0
        assert all(isinstance(e, TextDelta) for e in stream[:-1])
        answer = client.query(image, "what is it?", choices=["yes", "no"], max_tokens=4)
        assert answer.text in ("yes", "no")
        encoded = client.encode_image(image)
        assert "~" in encoded.image_id  # the cluster's id routes to where it was encoded
        assert client.encode_image(image).already_cached
        assert client.point(encoded, "ball", max_objects=2).finish_reason
        assert client.detect(encoded, "ball", max_objects=2).finish_reason
        assert client.segment(encoded, "ball").finish_reason
        with grpc.insecure_channel(way_in.target) as channel:
            asked = health_pb2.HealthCheckRequest(service="vlm.v1.VisionLanguage")
            answer = health_pb2_grpc.HealthStub(channel).Check(asked, timeout=HANG_GUARD_S)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        # The server's own errors come through with their code and field; so do its keys.
        with way_in.client(key=None) as stranger, pytest.raises(VlmError) as err:
            stranger.model_info()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(VlmError) as err:
            client.detect(b"not a picture", "ball")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("door", [0, 1], ids=["gateway", "ray"])
def test_every_http_route_through_the_door(cluster: Cluster, door: int) -> None:
    url, picture = cluster.doors[door].url, data_url(sample_image_bytes())
    few = {"max_tokens": 6}
    status, body = post_json(f"{url}/v1/caption", {"image_url": picture}, headers={})
    assert status == 401, body
    status, body = post_json(
        f"{url}/v1/caption", {"image_url": picture, "settings": few}, headers=AUTH
    )
    assert status == 200 and "caption" in body
    status, _, raw = post(
        f"{url}/v1/query",
        {"image_url": picture, "question": "hi", "stream": True, "settings": few},
        headers=AUTH,
    )
    sse = events(raw)
    assert status == 200 and sse[-1]["completed"] is True
    for task in ("point", "detect"):
        body = {"image_url": picture, "object": "ball"}
        status, body = post_json(f"{url}/v1/{task}", body, headers=AUTH)
        assert status == 200, body
    body = {"image_url": picture, "object": "ball"}
    status, body = post_json(f"{url}/v1/segment", body, headers=AUTH)
    assert status == 200 and "path" in body
    chat = {
        "model": "moondream",
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    status, _, raw = post(f"{url}/v1/chat/completions", chat, headers=AUTH)
    assert status == 200 and events(raw)[-1] == "[DONE]"
    status, body = post_json(f"{url}/v1/query", {"question": 7}, headers=AUTH)
    assert status == 400 and body["error"]["field"] == "question", body
    status, body = post_json(f"{url}/v1/query", {"question": "x" * BODY_LIMIT}, headers=AUTH)
    assert status == 413 and body["error"]["code"] == "RESOURCE_EXHAUSTED", body
    for path in ("/v1/models", "/openapi.json", "/health", "/ready"):
        request = urllib.request.Request(url + path, headers=AUTH)
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200, path
            if path == "/v1/models":
                assert json.loads(r.read())["data"]


def _received(cluster: Cluster) -> dict[str, float]:
    return {
        name: value(text, "vlm_requests_received_total", door="grpc")
        for name, text in cluster.metrics().items()
    }


@pytest.mark.parametrize("door", [0, 1], ids=["gateway", "ray"])
def test_the_same_image_lands_on_the_same_replica(cluster: Cluster, door: int) -> None:
    with cluster.doors[door].client() as client:
        for seed in range(3):  # one image at a time: nothing else loads the replicas
            image = _picture(100 + 10 * door + seed)
            before = _received(cluster)
            for _ in range(4):
                client.query(image, "what colour?", max_tokens=2)
            encoded = client.encode_image(image)
            client.query(encoded, "and now?", max_tokens=2)
            after = _received(cluster)
            grew = {name: after[name] - before.get(name, 0) for name in after}
            assert sorted(grew.values()) == [0, 6], grew


def _replica_actor(name: str) -> Any:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#{name}") and "SERVE_REPLICA" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no actor for replica {name}")


def _in_flight(cluster: Cluster) -> dict[str, float]:
    return {
        name: value(text, "vlm_requests_in_flight", door="grpc")
        for name, text in cluster.metrics().items()
    }


def test_a_replica_killed_mid_load(cluster: Cluster) -> None:
    streams = 6
    started = threading.Barrier(streams + 1, timeout=HANG_GUARD_S)
    outcomes: list[Any] = [None] * streams

    def run(i: int) -> None:
        with cluster.doors[i % 2].client() as client:
            it = client.caption_stream(_picture(200 + i), "long", max_tokens=LONG_TOKENS)
            try:
                first = next(it)
            except VlmError as err:  # fails the test below, without hanging it
                outcomes[i] = err
                started.wait()
                return
            started.wait()
            try:
                outcomes[i] = [first, *it][-1]
            except VlmError as err:
                outcomes[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait()  # every stream has produced its first event
    assert not any(isinstance(o, VlmError) for o in outcomes), outcomes
    busy = {n: c for n, c in _in_flight(cluster).items() if c > 0}
    assert busy, "no replica holds a stream"
    victim = max(busy, key=busy.__getitem__)
    ray.kill(_replica_actor(victim), no_restart=False)
    for t in threads:
        t.join(HANG_GUARD_S)
    failed = [o for o in outcomes if isinstance(o, VlmError)]
    done = [o for o in outcomes if isinstance(o, TextResult)]
    assert len(failed) + len(done) == streams, outcomes
    assert 1 <= len(failed) <= busy[victim], outcomes
    assert {f.code for f in failed} == {grpc.StatusCode.UNAVAILABLE}, failed
    # New requests go to the replica that lives (through either door, whichever replica
    # their picture's home was), then Ray brings a new one up.
    for way_in in cluster.doors:
        with way_in.client() as client:
            for seed in range(4):
                assert client.query(_picture(300 + seed), "ok?", max_tokens=2).finish_reason
    _until(lambda: len(set(cluster.metrics()) - {victim}) >= 2, "a new replica registers")
    _until(
        lambda: (
            serve.status()
            .applications[APP_NAME]
            .deployments["VisionLanguage"]
            .replica_states.get("RUNNING", 0)
            >= 2
        ),
        "Ray reports two running replicas",
    )


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for progress Ray makes on its own (polling it gently)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.2)


def test_drain_finishes_accepted_streams_then_stops(cluster: Cluster) -> None:
    """Last: as ``vlm cluster`` drains on SIGTERM: the gateway drains, then deleting the
    application drains Ray's proxies and every replica."""
    first = threading.Barrier(len(cluster.doors) + 1, timeout=HANG_GUARD_S)
    outcome: list[Any] = []

    def run(way_in: Door) -> None:
        with way_in.client() as client:
            it = client.caption_stream(_picture(400), "long", max_tokens=300)
            events_ = [next(it)]
            first.wait()
            events_.extend(it)
            outcome.append(events_[-1])

    streams = [threading.Thread(target=run, args=(d,)) for d in cluster.doors]
    for t in streams:
        t.start()
    first.wait()
    cluster.gateway.call(cluster.gateway.gateway.stop(HANG_GUARD_S))
    serve.delete(APP_NAME)  # returns once every replica drained and stopped
    for t in streams:
        t.join(HANG_GUARD_S)
    assert len(outcome) == 2 and all(isinstance(o, TextResult) for o in outcome), outcome
    for way_in in cluster.doors:
        with way_in.client() as client, pytest.raises(VlmError):
            client.model_info()
