"""Hostile requests, sent from a process of their own (so that building and sending them never
takes the GIL of the server under test): each returns the status it got back."""

from __future__ import annotations

import base64
import functools
import json
import random
import string
import urllib.error
import urllib.request

import grpc

from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc

MIB = 1 << 20


def _stub(target: str) -> tuple[grpc.Channel, pb_grpc.VisionLanguageStub]:
    limit = 64 * MIB
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    channel = grpc.insecure_channel(target, options=options)
    return channel, pb_grpc.VisionLanguageStub(channel)


def _grpc(target: str, method: str, request: object, timeout: float = 60) -> str:
    channel, stub = _stub(target)
    with channel:
        try:
            result = getattr(stub, method)(request, timeout=timeout)
            if method in ("Caption", "Query"):
                list(result)
        except grpc.RpcError as err:
            return err.code().name  # type: ignore[attr-defined]
    return "OK"


def _post(url: str, body: bytes) -> str:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return str(response.status)
    except urllib.error.HTTPError as err:
        return str(err.code)


@functools.cache
def _fake_jpeg() -> bytes:
    return b"\xff\xd8\xff" + bytes(22_000_000 - 3)


@functools.cache
def _fake_jpeg_body() -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(_fake_jpeg()).decode()
    return json.dumps({"image_url": url}).encode()


@functools.cache
def _big_strings_body() -> str:
    return json.dumps({"question": "q", "image_url": "data:image/png;base64," + "A" * (30 * MIB)})


def choices_query(target: str, http_url: str, attempt: int) -> str:
    """16 choices of 1,024 random characters, max_tokens 2000: new ones on each attempt (the
    server caches refusals)."""
    rng = random.Random(attempt)
    choices = ["".join(rng.choices(string.ascii_letters, k=1024)) for _ in range(16)]
    settings = pb.GenerationSettings(max_tokens=2000)
    return _grpc(
        target, "Query", pb.QueryRequest(question="which?", choices=choices, settings=settings)
    )


def fake_jpeg_grpc(target: str, http_url: str, attempt: int) -> str:
    return _grpc(target, "Caption", pb.CaptionRequest(image_bytes=_fake_jpeg()))


def fake_jpeg_http(target: str, http_url: str, attempt: int) -> str:
    return _post(f"{http_url}/caption", _fake_jpeg_body())


def long_question_grpc(target: str, http_url: str, attempt: int) -> str:
    return _grpc(target, "Query", pb.QueryRequest(question="why? " * 2_000_000))


def big_json_http(target: str, http_url: str, attempt: int) -> str:
    return _post(f"{http_url}/query", _big_strings_body().encode())


@functools.cache
def _long_question_body() -> bytes:
    return json.dumps({"question": "A" * (30 * MIB), "image_url": None}).encode()


def long_question_http(target: str, http_url: str, attempt: int) -> str:
    return _post(f"{http_url}/query", _long_question_body())


def prepare() -> None:
    """Build the large payloads ahead of the measured windows."""
    _fake_jpeg_body()
    _big_strings_body()
    _long_question_body()
