"""JPEGs left encoded by the server for its engine's process to decode on the GPU.

The server checks the header and keys the picture by its bytes (`EncodedImage`); the engine
process decodes it on a thread of its own before admission, unless its image prefix is
cached. On the CPU the GPU decoder is a stand-in decoding with simplejpeg, so every crop
must equal the host path's; the tests marked ``gpu`` run the real decoders.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from image_pipeline import (
    EncodedImage,
    HostImage,
    ImageError,
    ImageErrorReason,
    ImageLimits,
    ImagePreparer,
    PreparedImage,
)
from image_pipeline.gpu_jpeg import encoded_digest
from tests.support.jpegs import HostDecoder, encode, oriented_jpeg, photo
from tests.support.service_harness import ServerThread, wait_for
from tests.test_engine_process import _config, _next, _request, _StandInEngine, served_host
from vlm_server.client import VisionLanguageClient, VlmError
from vlm_server.engine.api import (
    EngineError,
    ErrorCode,
    Finished,
    GenerationRequest,
    Task,
)
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.engine.process.client import ProcessEngine
from vlm_server.engine.process.shared_pixels import shared_map
from vlm_server.engine.process.wire import (
    Accepted,
    Cancel,
    Refused,
    Stats,
    Submit,
    dumps,
    loads,
)
from vlm_server.frontend.images import ImageCache, ImageResolver
from vlm_server.models.interface import LoadedModel
from vlm_server.server import service as server_module
from vlm_server.server.engines import engine_factory

PHOTO = encode(photo(200, 150), quality=90)


def _crops_equal(a: PreparedImage, b: PreparedImage) -> None:
    assert (a.tiling, a.width, a.height, a.num_crops) == (b.tiling, b.width, b.height, b.num_crops)
    assert torch.equal(a.crops, b.crops)


# ---------------------------------------------------------------- the server's side


def test_a_large_enough_jpeg_stays_encoded_with_the_gpu_paths_key() -> None:
    host = ImagePreparer(reduced_decode=False)
    encoded = host.encoded(PHOTO, 200 * 150)
    assert isinstance(encoded, EncodedImage)
    assert encoded.data is PHOTO and encoded.nbytes == len(PHOTO)
    # The same metadata and key as the in-process GPU path gives.
    on_gpu = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=HostDecoder()).prepare(PHOTO)
    assert encoded.content_hash == on_gpu.content_hash == encoded_digest(PHOTO, (150, 200))
    assert (encoded.tiling, encoded.num_crops) == (on_gpu.tiling, on_gpu.num_crops)
    assert (encoded.width, encoded.height, encoded.decoded_size) == (200, 150, (150, 200))


def test_a_known_digest_of_the_bytes_gives_the_same_key() -> None:
    """The server hashes the bytes once: its digest of them makes the same key."""
    from image_pipeline.gpu_jpeg import encoded_digest as key

    digest = blake3.blake3(PHOTO).digest()
    assert key(PHOTO, (150, 200), digest) == key(PHOTO, (150, 200))
    assert key(PHOTO, (150, 200)) != key(PHOTO, (200, 150))  # the size is in the key
    encoded = ImagePreparer().encoded(PHOTO, 1, digest)
    assert encoded is not None and encoded.content_hash == key(PHOTO, (150, 200))


def test_small_pictures_other_formats_and_zero_are_decoded_by_the_server() -> None:
    host = ImagePreparer()
    assert host.encoded(PHOTO, 200 * 150 + 1) is None
    assert host.encoded(PHOTO, 0) is None
    assert host.encoded(encode(photo(200, 150), fmt="PNG"), 1) is None
    assert host.encoded(encode(photo(200, 150, mode="CMYK")), 1) is None  # the host's colours


def test_an_oriented_jpeg_is_keyed_and_tiled_upright() -> None:
    data = oriented_jpeg(6, 160, 90)  # a phone's portrait photo: stored 160 wide, shown 90
    encoded = ImagePreparer().encoded(data, 1)
    assert encoded is not None and (encoded.width, encoded.height) == (90, 160)
    assert encoded.content_hash == encoded_digest(data, (160, 90))


def test_the_header_checks_still_refuse_before_anything_is_kept() -> None:
    small = ImageLimits(max_image_pixels=100 * 100)
    with pytest.raises(ImageError) as err:
        ImagePreparer(small).encoded(PHOTO, 1)
    assert err.value.reason is ImageErrorReason.TOO_MANY_PIXELS
    with pytest.raises(ImageError):
        ImagePreparer().encoded(b"\xff\xd8\xff\xe0 not a JPEG", 1)


def test_a_picture_larger_than_the_whole_budget_takes_the_host_path() -> None:
    from image_pipeline import DecodeBudget

    tight = ImagePreparer(budget=DecodeBudget(200 * 150 * 3 - 1))
    assert tight.encoded(PHOTO, 1) is None
    assert ImagePreparer(budget=DecodeBudget(200 * 150 * 3)).encoded(PHOTO, 1) is not None


def test_the_resolver_keeps_large_jpegs_encoded_and_decodes_the_rest() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(2) as pool:
            resolver = ImageResolver(
                ImageLimits(),
                ImageCache(64 << 20),
                pool,
                ImagePreparer(device="cpu"),
                host_only=True,
                encoded_min_pixels=200 * 150,
            )
            large = await resolver.decode(PHOTO)
            assert isinstance(large, EncodedImage)
            # Its bytes wait in shared memory, to cross to the engine process as a descriptor.
            assert shared_map(large.data) is not None
            assert bytes(large.data) == PHOTO and large.nbytes == len(PHOTO)
            data, shared = dumps(Submit(1, _query(large)))
            assert len(shared) == 1 and len(data) < 4096
            crossed = loads(data, [os.dup(shared[0].fd)])
            assert isinstance(crossed, Submit)
            copy = crossed.request.image
            assert isinstance(copy, EncodedImage) and bytes(copy.data) == PHOTO
            # The engine's side decodes what crossed as it would the bytes themselves.
            preparer = ImagePreparer(reduced_decode=False)
            _crops_equal(preparer.prepare_encoded(copy), preparer.prepare(PHOTO))
            assert await resolver.decode(PHOTO) is large  # the same bytes: no work at all
            assert resolver.encoding_hits == 1
            assert resolver.cache.get(large.content_hash) is large
            small = await resolver.decode(encode(photo(120, 90), quality=90))
            assert isinstance(small, HostImage)
            png = await resolver.decode(encode(photo(200, 150), fmt="PNG"))
            assert isinstance(png, HostImage)

    asyncio.run(run())


def test_only_a_resolver_for_an_engine_process_keeps_jpegs_encoded() -> None:
    async def run() -> None:
        with ThreadPoolExecutor(1) as pool:
            resolver = ImageResolver(
                ImageLimits(), ImageCache(64 << 20), pool, encoded_min_pixels=1
            )
            assert isinstance(await resolver.decode(PHOTO), PreparedImage)

    asyncio.run(run())


# ---------------------------------------------------------------- the engine's decode


def test_prepare_encoded_with_the_gpu_decoder_equals_the_in_process_gpu_path() -> None:
    encoded = ImagePreparer().encoded(PHOTO, 1)
    assert encoded is not None
    decoder = HostDecoder()
    engine_side = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder)
    prepared = engine_side.prepare_encoded(encoded)
    assert decoder.calls == 1
    assert prepared.content_hash == encoded.content_hash
    _crops_equal(prepared, engine_side.prepare(PHOTO))


@pytest.mark.parametrize("decoder", [None, HostDecoder(fail=True)], ids=["none", "failing"])
def test_prepare_encoded_falls_back_to_the_host_decoders_keeping_the_key(
    decoder: HostDecoder | None,
) -> None:
    encoded = ImagePreparer().encoded(PHOTO, 1)
    assert encoded is not None
    engine_side = ImagePreparer(
        gpu_decode_min_pixels=1 if decoder else 0, gpu_decoder=decoder, reduced_decode=False
    )
    prepared = engine_side.prepare_encoded(encoded)
    assert prepared.content_hash == encoded.content_hash  # as the server keyed it
    _crops_equal(prepared, ImagePreparer(reduced_decode=False).prepare(PHOTO))
    if decoder is not None:
        assert decoder.calls == 1


def test_prepare_encoded_refuses_a_body_the_header_did_not_show_broken() -> None:
    encoded = ImagePreparer().encoded(PHOTO, 1)
    assert encoded is not None
    cut = dataclasses.replace(encoded, data=PHOTO[: len(PHOTO) // 3])
    with pytest.raises(ImageError):
        ImagePreparer().prepare_encoded(cut)


@settings(max_examples=150, deadline=None)
@given(
    cuts=st.lists(st.integers(0, len(PHOTO) - 1), max_size=4),
    flips=st.lists(st.tuples(st.integers(0, len(PHOTO) - 1), st.integers(1, 255)), max_size=6),
    stand_in=st.booleans(),
)
def test_damaged_jpegs_are_kept_or_refused_never_anything_else(
    cuts: list[int], flips: list[tuple[int, int]], stand_in: bool
) -> None:
    """Bytes damaged anywhere: the server's check keeps or refuses them (ImageError only),
    and what it kept the engine's side crops or refuses (ImageError only), with or
    without a GPU decoder in front of the host decoders."""
    data = bytearray(PHOTO)
    for at, bits in flips:
        data[at] ^= bits
    for at in sorted(cuts, reverse=True):
        del data[at:]
    damaged = bytes(data)
    try:
        encoded = ImagePreparer().encoded(damaged, 1)
    except ImageError:
        return
    if encoded is None:
        return
    engine_side = ImagePreparer(
        gpu_decode_min_pixels=1 if stand_in else 0,
        gpu_decoder=HostDecoder() if stand_in else None,
    )
    try:
        prepared = engine_side.prepare_encoded(encoded)
    except ImageError:
        return
    assert prepared.content_hash == encoded.content_hash
    assert prepared.num_crops == encoded.num_crops and prepared.tiling == encoded.tiling


# ---------------------------------------------------------------- a tiny engine


@pytest.fixture(scope="module")
def engine(tiny: LoadedModel) -> Iterator[BatchedEngine]:
    cfg = EngineConfig(max_batch_size=4, kv_budget_bytes=16 << 20)
    built = BatchedEngine(tiny, cfg)
    built.start()
    yield built
    built.close()


def _answer(engine: BatchedEngine, req: GenerationRequest) -> Finished:
    """``req`` through the engine's entry, which decodes a JPEG left encoded first."""
    route = _Answer()
    engine.admit(req, route)
    return route.result()


def _answer_as_queued(engine: BatchedEngine, req: GenerationRequest) -> Finished:
    """``req`` built and queued as it is, past the entry's decode: the runtime meets its
    JPEG still encoded."""
    route = _Answer()
    engine.queue(engine.build(req), route.emit)
    return route.result()


class _Answer:
    """A route (engine/intake.py) waiting for its request's result."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.ended = threading.Event()

    def accepted(self) -> None:
        pass

    def refused(self, error: EngineError) -> None:
        self.emit(error)

    def emit(self, event: object) -> None:
        self.events.append(event)
        if isinstance(event, Finished | EngineError):
            self.ended.set()

    def result(self) -> Finished:
        assert self.ended.wait(60), "no result"
        final = self.events[-1]
        assert isinstance(final, Finished), final
        return final


def _forget_prefixes(engine: BatchedEngine) -> None:
    """Drop every cached image prefix, once no ended request still holds one."""
    wait_for(engine.idle, what="the engine to be idle")
    engine.scheduler.prefix_cache.clear()
    assert len(engine.scheduler.prefix_cache) == 0


def _query(image: Any) -> GenerationRequest:
    return GenerationRequest(Task.QUERY, image, question="what?", max_tokens=6, temperature=0)


def test_the_engine_decodes_an_encoded_jpeg_and_answers_as_for_its_crops(
    engine: BatchedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    encoded = ImagePreparer().encoded(PHOTO, 1)
    assert encoded is not None
    decoded = engine.decode_image(_query(encoded))
    prepared = decoded.image
    assert isinstance(prepared, PreparedImage)
    assert prepared.content_hash == encoded.content_hash
    # The tiny engine's preparer has no GPU decoder: the host decoders' crops.
    _crops_equal(prepared, engine.runtime.image_preparer.prepare(PHOTO))
    _forget_prefixes(engine)
    first = _answer(engine, decoded)
    # Now its prefix is cached: the request goes on encoded, and nothing decodes it.
    again = engine.decode_image(_query(encoded))
    assert again.image is encoded
    with caplog.at_level("INFO", logger="vlm_server.engine.device.crops"):
        assert _answer(engine, again).text == first.text
        # Its prefix gone before it is admitted: the entry decodes it, off the scheduler.
        _forget_prefixes(engine)
        assert _answer(engine, again).text == first.text
    assert "scheduler thread" not in caplog.text
    # Its prefix gone after the entry let it pass: the runtime decodes it itself, with the
    # same answer, and says so (the steps waited meanwhile).
    _forget_prefixes(engine)
    with caplog.at_level("INFO", logger="vlm_server.engine.device.crops"):
        assert _answer_as_queued(engine, again).text == first.text
    assert "decoding an image on the scheduler thread" in caplog.text


def test_the_engine_refuses_a_broken_body_naming_the_image(engine: BatchedEngine) -> None:
    encoded = ImagePreparer().encoded(PHOTO, 1)
    assert encoded is not None
    cut = dataclasses.replace(encoded, data=PHOTO[: len(PHOTO) // 3])
    _forget_prefixes(engine)  # else its key's prefix, cached above, answers
    with pytest.raises(EngineError) as err:
        engine.decode_image(_query(cut))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and err.value.field == "image"
    assert err.value.message.startswith("image: corrupt")


def test_requests_without_an_encoded_image_pass_unchanged(engine: BatchedEngine) -> None:
    plain = _request("x")
    assert engine.decode_image(plain) is plain


# ---------------------------------------------------------------- the engine process's host


class _DecodingEngine(_StandInEngine):
    """The stand-in engine, decoding "encoded" images on whatever thread calls it: waits on
    ``decoding`` (set by default), refuses data starting with b"bad"."""

    def __init__(self, max_decoding: int = 256) -> None:
        super().__init__(max_decoding)
        self.decoding = threading.Event()
        self.decoding.set()
        self.started = threading.Event()
        self.stopped = threading.Event()  # a cancel reached a request still decoding
        self.threads: list[str] = []

    def stop_compiling(self, request: GenerationRequest) -> None:
        super().stop_compiling(request)
        self.stopped.set()

    def decode_image(self, request: GenerationRequest) -> GenerationRequest:
        image = request.image
        if not isinstance(image, EncodedImage):
            return request
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.decoding.wait(10)
        if image.data.startswith(b"bad"):
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "corrupt JPEG data", "image")
        return dataclasses.replace(request, image=None)


def _encoded(data: bytes = b"jpeg") -> EncodedImage:
    return EncodedImage(data, (1, 1), "key", 10, 10, 2)


@pytest.fixture
def host() -> Iterator[tuple[_DecodingEngine, Any, Any, Any, Any]]:
    with served_host(_DecodingEngine()) as served:
        yield served  # type: ignore[misc]


def test_the_host_decodes_off_its_command_thread_then_admits(host: Any) -> None:
    engine, _, commands, events, _ = host
    engine.decoding.clear()
    commands.send(Submit(1, dataclasses.replace(_request("img", "run"), image=_encoded())))
    assert engine.started.wait(10)
    commands.send(Submit(2, _request("plain", "run")))  # not blocked by the decode
    assert _next(events, Accepted).rid == 2
    engine.decoding.set()
    assert _next(events, Accepted).rid == 1
    assert engine.admitted["img"].request.image is None  # what decode_image gave
    assert engine.threads == [engine.threads[0]] and engine.threads[0].startswith("jpeg-decode")


def test_the_host_refuses_what_the_decode_refuses(host: Any) -> None:
    engine, _, commands, events, _ = host
    commands.send(Submit(1, dataclasses.replace(_request("b"), image=_encoded(b"bad"))))
    refused = _next(events, Refused)
    assert refused.rid == 1 and refused.error.field == "image"
    assert "b" not in engine.admitted


def test_a_request_cancelled_during_its_decode_is_never_built(host: Any) -> None:
    engine, _, commands, events, _ = host
    engine.decoding.clear()
    commands.send(Submit(1, dataclasses.replace(_request("slow", "run"), image=_encoded())))
    assert engine.started.wait(10)
    commands.send(Cancel(1))
    assert engine.stopped.wait(10)  # the host read the cancel before the decode ends
    engine.decoding.set()
    refused = _next(events, Refused)
    assert refused.rid == 1 and refused.error.code is ErrorCode.CANCELLED
    assert "slow" not in engine.built


# ---------------------------------------------------------------- a server, on the CPU


def test_a_server_leaving_jpegs_encoded_answers_as_one_decoding_them(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server told to leave JPEGs encoded, as it does for an engine process decoding
    on its GPU (here the engine process's preparer has no GPU decoder, so its host decoders
    decode them): the answers are those of the server decoding them itself; a body broken
    past a good header is refused with INVALID_ARGUMENT naming ``image``, and the server
    serves on."""
    data = encode(photo(200, 150, seed=5), quality=90)
    answers = {}
    config = _config(tiny_dir)
    with contextlib.ExitStack() as stack:
        # Both servers load at once (each its engine process): a server reads whether to
        # leave JPEGs encoded when it is made, so the second is made after the patch.
        servers = {}
        for leave in (False, True):
            if leave:
                monkeypatch.setattr(server_module, "engine_decode_min_pixels", lambda config: 1)
            servers[leave] = ServerThread(config, engine_factory(config))
            stack.callback(servers[leave].stop)
            servers[leave].start(wait_ready=False)
        for leave, running in servers.items():
            assert running.server is not None
            running.run(running.server.wait_ready())
            with VisionLanguageClient(running.target, timeout=60) as c:
                uploaded = c.encode_image(data)
                kept = running.server.core.images.cache.get(uploaded.image_id)
                assert isinstance(kept, EncodedImage if leave else HostImage)
                answers[leave] = c.caption(data, temperature=0.0, max_tokens=12).text
                if leave:
                    with pytest.raises(VlmError) as caught:
                        c.caption(data[: len(data) // 2], temperature=0.0, max_tokens=4)
                    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    assert caught.value.field == "image"
                    assert caught.value.message.startswith("image: corrupt")
                    assert c.query(uploaded, "what?", temperature=0.0, max_tokens=4).text
    assert answers[True] == answers[False]


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_an_engine_process_decodes_on_the_gpu_and_answers_as_in_process(tiny_dir: Path) -> None:
    """JPEGs left encoded by the server, decoded and cropped by the engine process on the
    GPU, give the greedy answers of the same decoder in the server's process."""
    data = encode(photo(640, 480, seed=3), quality=90)
    answers = {}
    for mode in ("off", "on"):
        config = _config(
            tiny_dir, device="cuda", engine_process=mode, image_gpu_decode_min_pixels=1
        )
        with (
            ServerThread(config, engine_factory(config)) as running,
            VisionLanguageClient(running.target, timeout=120) as c,
        ):
            assert running.server is not None
            engine = running.server.core.engine
            assert isinstance(engine, ProcessEngine) == (mode == "on")
            uploaded = c.encode_image(data)
            kept = running.server.core.images.cache.get(uploaded.image_id)
            assert isinstance(kept, EncodedImage if mode == "on" else PreparedImage)
            answers[mode] = [
                c.caption(data, temperature=0.0, max_tokens=16).text,
                [(b.x_min, b.y_min) for b in c.detect(data, "house").boxes],
                c.query(uploaded, "what?", temperature=0.0, max_tokens=8).text,
            ]
    assert answers["on"] == answers["off"]


def test_decodes_past_the_bound_are_refused_as_a_full_queue() -> None:
    with served_host(_DecodingEngine(max_decoding=1)) as (engine, _, commands, events, _):
        assert isinstance(engine, _DecodingEngine)
        engine.decoding.clear()
        commands.send(Submit(1, dataclasses.replace(_request("a", "run"), image=_encoded())))
        assert engine.started.wait(10)
        # The engine's stats count it (vlm_images_decoding), while no queue holds it yet.
        wait_for(lambda: _next(events, Stats).stats.images_decoding == 1, what="the count")
        commands.send(Submit(2, dataclasses.replace(_request("b", "run"), image=_encoded())))
        refused = _next(events, Refused)
        assert refused.rid == 2 and refused.error.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "decoded" in refused.error.message
        engine.decoding.set()
        assert _next(events, Accepted).rid == 1
        commands.send(Submit(3, dataclasses.replace(_request("c", "run"), image=_encoded())))
        assert _next(events, Accepted).rid == 3  # its place was given back
