"""The cluster's gateway without Ray: its routing bookkeeping, the HTTP affinity keys, and both
doors in front of stand-in replicas (bench/stand_in_replica.py, each its own process, so a test
can kill one as a replica dies). Assertions follow order and outcome, never wall-clock
windows; timeouts only keep a broken run from hanging."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

pytest.importorskip("blake3")

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.cluster.affinity import bytes_key
from vlm_server.cluster.gateway import Gateway
from vlm_server.cluster.gateway_grpc import METHODS, _abort, prepare
from vlm_server.cluster.http_keys import body_key, data_url_key
from vlm_server.cluster.replica_set import NoReplica, ReplicaSet

HANG_GUARD_S = 60.0
REPO = Path(__file__).resolve().parent.parent
AUTH = (("authorization", "Bearer k1"),)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


# --- ReplicaSet -------------------------------------------------------------------------------


def _set(names: list[str], load_factor: float = 1.25) -> ReplicaSet:
    replicas = ReplicaSet(load_factor, random.Random(0))
    replicas.update({n: {"grpc": f"h:{i}"} for i, n in enumerate(names)})
    for n in names:
        replicas.set_serving(n, True)
    return replicas


def test_a_key_stays_on_its_replica_and_keys_spread() -> None:
    replicas = _set(["a", "b", "c"])
    homes = {}
    for i in range(60):
        r = replicas.route(f"img{i}")
        assert r.cost == replicas.miss_cost  # a first sighting computes its prefix
        homes[f"img{i}"] = r.replica.name
        replicas.done(r)
    assert set(homes.values()) == {"a", "b", "c"}
    for key, home in homes.items():
        r = replicas.route(key)
        assert (r.replica.name, r.cost) == (home, 1.0)
        replicas.done(r)
    assert replicas.home_hits == replicas.routed == 120
    assert all(r.work == 0 and r.in_flight == 0 for r in replicas.members())


def test_members_that_do_not_serve_get_nothing() -> None:
    replicas = _set(["a", "b"])
    replicas.set_serving("a", False)
    for i in range(20):
        assert replicas.route(f"k{i}").replica.name == "b"
    replicas.update({"a": {"grpc": "h:0"}})  # b left the directory
    with pytest.raises(NoReplica):
        replicas.route("k0")
    replicas.set_serving("a", True)
    assert replicas.route("k0").replica.name == "a"


def test_new_pictures_balance_the_work_and_repeats_stay_with_their_prefix() -> None:
    replicas = _set(["a", "b"], load_factor=1.0)
    first = replicas.route("p0")  # a prefix to compute: miss_cost of work
    home = first.replica.name
    other = next(n for n in ("a", "b") if n != home)
    # New pictures go where the work is least, whatever their ring home ...
    assert replicas.route("new0").replica.name == other
    for i in range(1, 9):
        replicas.route(f"new{i}")
    a, b = (replicas.get(n).work for n in ("a", "b"))
    assert abs(a - b) <= replicas.miss_cost
    # ... while a repeat waits for its prefix unless the wait costs more than a prefix.
    assert replicas.route("p0").replica.name == home


def test_a_hot_picture_spreads_and_its_holders_share_it() -> None:
    replicas = _set(["a", "b"], load_factor=1.0)
    routed = [replicas.route("hot") for _ in range(40)]  # none finishes: a pile-up
    names = [r.replica.name for r in routed]
    assert set(names) == {"a", "b"}, "a hot picture never spread"
    assert sum(r.cost == replicas.miss_cost for r in routed) == 2  # one prefix per replica
    assert abs(names.count("a") - names.count("b")) <= 2
    for r in routed:
        replicas.done(r)


def test_unreachable_and_excluded_replicas_are_skipped() -> None:
    replicas = _set(["a", "b"])
    first = replicas.route("k")
    replicas.done(first)
    other = replicas.route("k", exclude=frozenset({first.replica.name}))
    assert other.replica.name != first.replica.name
    replicas.unreachable(first.replica)
    assert all(replicas.route(f"k{i}").replica.name == other.replica.name for i in range(10))


def test_a_moved_member_is_new_and_loads_never_go_negative() -> None:
    replicas = _set(["a"])
    r = replicas.route(None)
    replicas.update({"a": {"grpc": "elsewhere:1"}})  # restarted with other ports
    assert replicas.get("a").grpc == "elsewhere:1" and not replicas.get("a").serving
    replicas.done(r)
    replicas.done(r)
    assert r.replica.in_flight == 0 and r.replica.work == 0


# --- HTTP keys --------------------------------------------------------------------------------


def _data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("size", [1, 2, 3, 1000, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20])
def test_a_data_url_has_its_bytes_key(size: int) -> None:
    data = random.Random(size).randbytes(size)
    assert data_url_key(_data_url(data)) == bytes_key(data)


def test_body_keys_of_every_route_shape() -> None:
    data = b"picture"
    image = bytes_key(data)
    url = _data_url(data)
    assert body_key(json.dumps({"image_url": url, "question": "q"}).encode()) == image
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            },
        ]
    }
    assert body_key(json.dumps(chat).encode()) == image
    tuned = {"image_url": url, "model": "moondream-2/ft1@100"}
    assert body_key(json.dumps(tuned).encode()) == f"ft1@100|{image}"
    assert body_key(json.dumps({"settings": {"adapter": "x"}}).encode()) == "x"
    for junk in (b"", b"not json", b"[1]", json.dumps({"image_url": "data:,%%%"}).encode()):
        assert body_key(junk) is None
    clash = {"image_url": url, "variant": "a", "settings": {"adapter": "b"}}
    assert body_key(json.dumps(clash).encode()) == image  # the replica names the clash


def test_prepare_reads_the_key_and_strips_the_cluster_tag() -> None:
    query = METHODS["/vlm.v1.VisionLanguage/Query"]
    raw = pb.QueryRequest(image_bytes=b"abc", question="q").SerializeToString()
    assert prepare(query, raw) == (raw, bytes_key(b"abc"))
    tagged = pb.QueryRequest(image_id="id7~tag1", question="q").SerializeToString()
    data, key = prepare(query, tagged)
    assert key == "tag1" and pb.QueryRequest.FromString(data).image_id == "id7"
    assert prepare(query, b"\xff\xff") == (b"\xff\xff", None)


def test_a_lost_connection_reads_unavailable() -> None:
    class Context:
        trailing: Any = None

        def set_trailing_metadata(self, md: Any) -> None:
            self.trailing = md

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code, details)

    def err(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        with pytest.raises(RuntimeError) as raised:
            asyncio.run(_abort(Context(), err(code, "Socket closed")))  # type: ignore[arg-type]
        assert raised.value.args[0] == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(RuntimeError) as raised:
        asyncio.run(_abort(Context(), err(grpc.StatusCode.INTERNAL, "model bug")))  # type: ignore[arg-type]
    assert raised.value.args == (grpc.StatusCode.INTERNAL, "model bug")


# --- both doors in front of stand-in replicas ---------------------------------------------------


class Fake:
    """A stand-in replica process."""

    def __init__(self, name: str, busy: bool = False) -> None:
        self.name = name
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.stand_in_replica", name, *(["busy"] if busy else [])],
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"fake replica {name} did not start"
        self.entry = {**json.loads(line), "metrics": None}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(HANG_GUARD_S)


@pytest.fixture
def fakes() -> Iterator[dict[str, Fake]]:
    out = {name: Fake(name) for name in ("r1", "r2")}
    yield out
    for fake in out.values():
        fake.kill()


@asynccontextmanager
async def gateway(fakes: dict[str, Fake], body_limit: int = 1 << 20, credentials: Any = None):
    """A gateway over ``fakes``; the directory is re-read only when a test says so."""

    async def entries() -> dict[str, Any]:
        return {f.name: f.entry for f in fakes.values() if f.proc.poll() is None}

    gw = Gateway(entries, 1.25, 4 << 20, body_limit, refresh_s=3600)
    await gw.start("127.0.0.1", 0, -1, credentials=credentials)
    await gw.refresh()
    assert {r.name for r in gw.replicas.serving()} == set(fakes)
    try:
        yield gw
    finally:
        await gw.stop(5)


def _stub(gw: Gateway) -> tuple[grpc.aio.Channel, pb_grpc.VisionLanguageStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
    return channel, pb_grpc.VisionLanguageStub(channel)


async def _query(stub: Any, **fields: Any) -> list[pb.QueryResponse]:
    return [m async for m in stub.Query(pb.QueryRequest(**fields), metadata=AUTH)]


def _pictures(n: int) -> list[bytes]:
    return [f"picture-{i}".encode() * 10 for i in range(n)]


def test_every_method_goes_through_and_an_image_keeps_its_replica(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes) as gw:
            channel, stub = _stub(gw)
            homes = {}
            for picture in _pictures(16):
                answers = [await _query(stub, image_bytes=picture, question="q") for _ in range(3)]
                texts = {a[-1].result.text for a in answers}
                assert len(texts) == 1, texts  # every question on one replica
                name, image, auth = texts.pop().split("|")
                assert image == f"bytes:{len(picture)}" and auth == "Bearer k1"
                assert answers[0][0].delta.text == name  # deltas stream through
                homes[picture] = name
            assert set(homes.values()) == {"r1", "r2"}
            caption = [m async for m in stub.Caption(pb.CaptionRequest(image_bytes=b"x"))]
            assert [m.delta.text for m in caption[:3]] == ["a", "b", "c"]
            point_call = stub.Point(pb.PointRequest(image_bytes=b"x", object="o"))
            assert len((await point_call).points) == 1
            # Trailing metadata of a success (a server's request id) comes back too.
            assert ("x-replica", caption[-1].result.text) in tuple(
                await point_call.trailing_metadata()
            )
            query_call = stub.Query(pb.QueryRequest(image_bytes=b"x", question="q"))
            assert [m async for m in query_call][-1].result.text.startswith(caption[-1].result.text)
            assert ("x-replica", caption[-1].result.text) in tuple(
                await query_call.trailing_metadata()
            )
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.model_name in fakes
            # An uploaded picture's id routes where its bytes do, and reaches it untagged.
            picture = _pictures(1)[0]
            encoded = await stub.EncodeImage(pb.EncodeImageRequest(image_bytes=picture))
            assert encoded.image_id == f"id-{len(picture)}~{bytes_key(picture)}"
            answer = await _query(stub, image_id=encoded.image_id, question="q")
            assert answer[-1].result.text.split("|")[:2] == [homes[picture], f"id-{len(picture)}"]
            # The replica's status, details and trailing metadata come back unchanged.
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await _query(stub, image_bytes=picture, question="fail")
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert failed.value.details() == "question: asked to fail"
            assert ("x-reason", "asked-to") in tuple(failed.value.trailing_metadata())
            assert gw.replicas.home_hits == gw.replicas.routed - 1  # GetModelInfo has no key
            assert "vlm_gateway_routed_total" in gw.metrics_text()
            await channel.close()

    run(body())


def test_http_routes_by_the_same_key_and_streams(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes, body_limit=64 << 10) as gw:
            channel, stub = _stub(gw)
            base = f"http://127.0.0.1:{gw.http_port}"
            async with aiohttp.ClientSession() as http:
                for picture in _pictures(8):
                    grpc_home = (await _query(stub, image_bytes=picture, question="q"))[-1]
                    request = {"image_url": _data_url(picture), "question": "q"}
                    headers = {"Authorization": "Bearer k2"}
                    async with http.post(
                        f"{base}/v1/query?x=1", json=request, headers=headers
                    ) as r:
                        assert r.status == 200
                        answer = await r.json()
                        assert r.headers["X-Replica"] == answer["answer"]
                    assert answer["answer"] == grpc_home.result.text.split("|")[0]
                    assert answer["auth"] == "Bearer k2" and answer["path"] == "/v1/query?x=1"
                async with http.post(f"{base}/v1/query", json={**request, "stream": True}) as r:
                    chunks = [line async for line in r.content if line.startswith(b"data:")]
                assert len(chunks) == 3
                async with http.get(f"{base}/v1/models") as r:
                    assert (await r.json())["data"][0]["id"] in fakes
                async with http.post(f"{base}/v1/query", data=b"x" * (65 << 10)) as r:
                    assert r.status == 413
                    assert (await r.json())["error"]["field"] == "body"
            await channel.close()

    run(body())


def test_a_replica_lost_mid_stream_fails_it_unavailable_and_new_requests_move(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes) as gw:
            channel, stub = _stub(gw)
            picture = _pictures(1)[0]
            home = (await _query(stub, image_bytes=picture, question="q"))[-1].result.text
            home = home.split("|")[0]
            call = stub.Query(pb.QueryRequest(image_bytes=picture, question="hang"))
            first = await call.read()
            assert first.delta.text == home
            fakes[home].kill()
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await call.read()
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
            # Before the gateway re-reads the directory: the same picture goes elsewhere.
            other = (await _query(stub, image_bytes=picture, question="q"))[-1].result.text
            assert other.split("|")[0] != home
            point = await stub.Point(pb.PointRequest(image_bytes=picture, object="o"))
            assert len(point.points) == 1
            await gw.refresh()
            assert [r.name for r in gw.replicas.members()] == [n for n in fakes if n != home]
            fakes[next(n for n in fakes if n != home)].kill()
            await gw.refresh()
            with pytest.raises(grpc.aio.AioRpcError) as none:
                await stub.Point(pb.PointRequest(image_bytes=picture, object="o"))
            assert none.value.code() == grpc.StatusCode.UNAVAILABLE
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"http://127.0.0.1:{gw.http_port}/v1/query", json={}) as r,
            ):
                assert r.status == 503
            await channel.close()

    run(body())


def test_an_http_stream_cut_by_a_lost_replica_is_cut_for_the_client(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes) as gw, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{gw.http_port}/v1/query"
            picture = _data_url(_pictures(1)[0])
            async with http.post(url, json={"image_url": picture}) as r:
                home = (await r.json())["answer"]
            request = {"image_url": picture, "stream": True, "question": "hang"}
            async with http.post(url, json=request) as r:
                assert (await r.content.readline()).startswith(b"data:")
                fakes[home].kill()
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.content.read()  # not a clean end: it cannot pass for a whole one
            async with http.post(url, json={"image_url": picture}) as r:  # moves on
                assert r.status == 200 and (await r.json())["answer"] != home

    run(body())


def test_tls_ends_at_the_gateway(fakes, tmp_path: Path) -> None:
    from tests.support.certs import make_certs
    from vlm_server.client import Security, VisionLanguageClient, VlmError
    from vlm_server.rpc.tls import server_credentials

    certs = make_certs(tmp_path)
    tls = server_credentials(str(certs / "server.pem"), str(certs / "server.key"))

    async def body() -> None:
        async with gateway(fakes, credentials=tls) as gw:
            target = f"127.0.0.1:{gw.port}"

            def calls() -> None:  # the blocking client, off the gateway's loop
                secure = Security(ca_cert=certs / "ca.pem")
                with VisionLanguageClient(target, timeout=30, security=secure) as client:
                    assert client.model_info().model_name in fakes
                with VisionLanguageClient(target, timeout=5) as plain:
                    with pytest.raises(VlmError) as caught:
                        plain.model_info()
                    assert caught.value.code == grpc.StatusCode.UNAVAILABLE

            await asyncio.to_thread(calls)

    run(body())


def test_a_replica_busy_for_now_hands_its_requests_to_another() -> None:
    busy, free = Fake("r1", busy=True), Fake("r2")
    both = {"r1": busy, "r2": free}
    try:

        async def body() -> None:
            async with gateway(both) as gw, aiohttp.ClientSession() as http:
                channel, stub = _stub(gw)
                for picture in _pictures(8):  # some have the busy replica as their home
                    answer = await _query(stub, image_bytes=picture, question="q")
                    assert answer[-1].result.text.startswith("r2|")
                    url = f"http://127.0.0.1:{gw.http_port}/v1/query"
                    async with http.post(url, json={"image_url": _data_url(picture)}) as r:
                        assert r.status == 200 and (await r.json())["answer"] == "r2"
                free.kill()  # the busy one alone: its refusal reaches the client
                await gw.refresh()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _query(stub, image_bytes=b"p", question="q")
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                async with http.post(url, json={"image_url": _data_url(b"p")}) as r:
                    assert r.status == 429
                await channel.close()

        run(body())
    finally:
        for fake in both.values():
            fake.kill()


def test_drain_finishes_accepted_calls_then_refuses(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes) as gw:
            channel, stub = _stub(gw)
            call = stub.Query(pb.QueryRequest(image_bytes=b"p", question="slow"))
            assert (await call.read()).delta.text in fakes
            stopping = asyncio.create_task(gw.stop(HANG_GUARD_S))
            last = await call.read()
            assert last.result.text.split("|")[0] in fakes
            await stopping
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            await channel.close()

    run(body())


def test_workers_share_the_ports_and_agree_on_every_images_replica(fakes) -> None:
    from vlm_server.cluster.gateway_workers import GatewayWorkers, WorkerSettings

    async def body() -> None:
        async def entries() -> dict[str, Any]:
            return {f.name: f.entry for f in fakes.values()}

        settings = WorkerSettings("127.0.0.1", 0, -1, 1.25, 4 << 20, 1 << 20, refresh_s=0.1)
        workers = GatewayWorkers(entries, settings, 2)
        await workers.start()
        try:
            target = f"127.0.0.1:{workers.port}"
            homes: dict[bytes, set[str]] = {}
            answered = 0
            for attempt in range(60):  # a new connection each: the kernel picks a worker
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = pb_grpc.VisionLanguageStub(channel)
                    picture = _pictures(4)[attempt % 4]
                    try:
                        answer = await _query(stub, image_bytes=picture, question="q")
                    except grpc.aio.AioRpcError as err:  # a worker yet to see a replica serve
                        assert err.code() == grpc.StatusCode.UNAVAILABLE
                        await asyncio.sleep(0.1)
                        continue
                    homes.setdefault(picture, set()).add(answer[-1].result.text.split("|")[0])
                    answered += 1
            assert homes and all(len(names) == 1 for names in homes.values()), homes
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{workers.http_port}/v1/models") as r,
            ):
                assert r.status == 200
            assert answered > 30
            while f"vlm_gateway_home_hits_total {answered}\n" not in workers.metrics_text():
                await asyncio.sleep(0.1)  # the workers' counts arrive every refresh
            assert all(c["home_hits"] for c in workers._counts)  # both took connections
        finally:
            await workers.stop(5)

    run(body())


def test_a_large_picture_routes_like_a_small_one(fakes) -> None:
    async def body() -> None:
        async with gateway(fakes) as gw:
            channel, stub = _stub(gw)
            big = random.Random(5).randbytes(3 << 20)  # keyed off the event loop
            first = await _query(stub, image_bytes=big, question="q")
            again = await _query(stub, image_bytes=big, question="q")
            assert first[-1].result.text == again[-1].result.text
            assert first[-1].result.text.split("|")[1] == f"bytes:{len(big)}"
            await channel.close()

    run(body())
