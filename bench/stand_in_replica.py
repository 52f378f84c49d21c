"""A stand-in for a replica's doors, for the gateway's tests and benchmark: the API over gRPC
and HTTP in its own process (so a test can kill it as a replica dies), no model.

``python -m bench.stand_in_replica NAME [busy]`` prints one JSON line with its ``grpc`` and
``http`` addresses, then serves until killed; ``busy``: every query is refused as a full queue
is (RESOURCE_EXHAUSTED, HTTP 429). Answers say which replica gave them and what arrived:
a Query's result text is ``NAME|<image>|<authorization>``; the question ``hang`` streams one
delta and then waits forever, ``slow`` waits half a second before its result, ``fail`` ends
with INVALID_ARGUMENT and trailing metadata.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["VisionLanguage"].full_name


def _auth(context: grpc.aio.ServicerContext) -> str:
    return next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")


def _image(request: Any) -> str:
    which = request.WhichOneof("image")
    if which == "image_id":
        return request.image_id
    return f"bytes:{len(request.image_bytes)}" if which else ""


class Servicer(pb_grpc.VisionLanguageServicer):
    def __init__(self, name: str, busy: bool) -> None:
        self.name = name
        self.busy = busy

    async def Query(self, request: pb.QueryRequest, context: grpc.aio.ServicerContext):
        if self.busy:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")
        if request.question == "fail":
            context.set_trailing_metadata((("x-reason", "asked-to"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "question: asked to fail")
        yield pb.QueryResponse(delta=pb.TextDelta(text=self.name))
        if request.question == "hang":
            await asyncio.Event().wait()
        if request.question == "slow":  # long enough for a drain to start meanwhile
            await asyncio.sleep(0.5)
        text = f"{self.name}|{_image(request)}|{_auth(context)}"
        context.set_trailing_metadata((("x-replica", self.name),))
        yield pb.QueryResponse(result=pb.TextResult(text=text))

    async def Caption(self, request: pb.CaptionRequest, context: grpc.aio.ServicerContext):
        for word in ("a", "b", "c"):
            yield pb.CaptionResponse(delta=pb.TextDelta(text=word))
        yield pb.CaptionResponse(result=pb.TextResult(text=self.name))

    async def Point(self, request: pb.PointRequest, context: grpc.aio.ServicerContext):
        context.set_trailing_metadata((("x-replica", self.name),))
        return pb.PointResponse(points=[pb.NormalizedPoint(x_norm=0.5, y_norm=0.5)])

    async def EncodeImage(self, request: pb.EncodeImageRequest, context: grpc.aio.ServicerContext):
        return pb.EncodeImageResponse(image_id=f"id-{len(request.image_bytes)}", width=1)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext):
        return pb.GetModelInfoResponse(model_name=self.name)


async def _http(name: str, busy: bool) -> web.AppRunner:
    async def query(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if busy:
            error = {"code": "RESOURCE_EXHAUSTED", "message": "the queue is full", "field": None}
            return web.json_response({"error": error}, status=429)
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in ("a", "b", name):
                await response.write(f"data: {json.dumps({'chunk': chunk})}\n\n".encode())
                if body.get("question") == "hang":
                    await asyncio.Event().wait()
            await response.write_eof()
            return response
        auth = request.headers.get("Authorization", "")
        answer = {"answer": name, "auth": auth, "path": request.path_qs}
        return web.json_response(answer, headers={"X-Replica": name})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": name}]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/query", query)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def main(name: str, busy: bool = False) -> None:
    server = grpc.aio.server()
    pb_grpc.add_VisionLanguageServicer_to_server(Servicer(name, busy), server)
    states = health.aio.HealthServicer()
    await states.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(states, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    runner = await _http(name, busy)
    http_port = runner.addresses[0][1]
    print(json.dumps({"grpc": f"127.0.0.1:{port}", "http": f"127.0.0.1:{http_port}"}), flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:] == ["busy"]))
