"""Finetune adapters through the doors: gRPC ``settings.adapter``; HTTP ``settings.adapter``,
``variant`` and the official client's ``model="<base>/<id>@<step>"``; the OpenAI door's
model; GetModelInfo and /v1/models listing resident adapters; a download from a local HTTP
server (the reference's URL and header); errors naming the client's field."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import grpc
import pytest
import torch
from PIL import Image

from image_pipeline import PreparedImage, prepare_image, sample_image_bytes
from tests.http_support import data_url, moondream_client, post_json
from tests.support.http_files import QuietHandler
from tests.support.service_harness import (
    ServerThread,
    in_process,
    local_config,
    module_server,
    wait_for,
)
from vlm_server.api.v1 import vision_language_pb2 as pb
from vlm_server.api.v1 import vision_language_pb2_grpc as pb_grpc
from vlm_server.client import VisionLanguageClient, VlmError
from vlm_server.cluster.metrics import value
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import files
from vlm_server.models.lora.store import AdapterStore
from vlm_server.models.lora.writer import random_state, write_random
from vlm_server.reference import ReferenceGenerator, SamplingSettings

MIB = 1 << 20
RANK = 4
KEY = "secret-key"
GREEDY = SamplingSettings(temperature=0.0, max_tokens=8)
GATE_TIMEOUT_S = 60.0  # a gate left closed must not hang the run


class _Variants(QuietHandler):
    """Serves ``/v1/variants/<id>/download`` as the cloud does, with the key required."""

    blobs: ClassVar[dict[str, bytes]] = {}
    seen: ClassVar[list[tuple[str, str | None]]] = []
    # Holds the answers for a "slow..." finetune while cleared: a download that lasts until
    # the test has seen what it wants meanwhile.
    slow_gate: ClassVar[threading.Event] = threading.Event()

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("X-Moondream-Auth")))
        name = self.path.removeprefix("/v1/variants/").removesuffix("/download")
        if name.startswith("slow"):
            self.slow_gate.wait(GATE_TIMEOUT_S)
        if self.headers.get("X-Moondream-Auth") != KEY:
            self.send_error(401)
        elif name not in self.blobs:
            self.send_error(404)
        else:
            self.send_body(self.blobs[name])


@pytest.fixture(scope="module")
def endpoint(tiny: LoadedModel) -> Iterator[str]:
    buf = io.BytesIO()
    torch.save(random_state(tiny.model.text.lora_targets, RANK, seed=3, scale=0.3), buf)
    _Variants.slow_gate.set()
    _Variants.blobs = {
        "ft1@100": buf.getvalue(),
        "slow@7": buf.getvalue(),
        "junk@1": b"not a checkpoint",
    }
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Variants)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def folder(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapters")
    write_random(out, "local", tiny.model.text.lora_targets, RANK, seed=1, scale=0.3)
    return out


@pytest.fixture(scope="module")
def server(tiny: LoadedModel, folder: Path, endpoint: str) -> Iterator[ServerThread]:
    config = EngineConfig(
        max_batch_size=8,
        kv_budget_bytes=16 * MIB,
        adapters_dir=str(folder),
        adapter_endpoint=endpoint,
        adapter_api_key=KEY,
        max_adapter_rank=RANK,
    )
    with ServerThread(
        local_config(http_port=-1), in_process(lambda: BatchedEngine(tiny, config))
    ) as s:
        yield s


def _reference(tiny: LoadedModel, path: Path, name: str) -> ReferenceGenerator:
    weights = files.load(path, tiny.model.text.lora_targets, RANK, name)
    return ReferenceGenerator(tiny.model, tiny.tokenizer, weights)


def test_grpc_settings_adapter_equals_the_reference(
    server: ServerThread, tiny: LoadedModel, folder: Path, sample_image: PreparedImage
) -> None:
    want = _reference(tiny, folder / "local" / "final.pt", "local")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.VisionLanguageStub(channel)
        settings = pb.GenerationSettings(temperature=0, max_tokens=8, adapter="local")
        req = pb.CaptionRequest(image_bytes=sample_image_bytes(), settings=settings)
        final = [r for r in stub.Caption(req, timeout=60) if r.HasField("result")][-1]
        assert final.result.text == want.caption(sample_image, "normal", GREEDY).text
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert ("local", RANK) in [(a.id, a.rank) for a in info.adapters]
        assert info.limits.max_adapters == 8 and info.limits.max_adapter_rank == RANK
        bad = pb.CaptionRequest(
            image_bytes=sample_image_bytes(),
            settings=pb.GenerationSettings(adapter="nowhere-known"),
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Caption(bad, timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "settings.adapter" in err.value.details()
        # gRPC has no model field: the HTTP spelling <model>/<id> is refused, never read as
        # the base model.
        spelled = pb.GenerationSettings(adapter=f"{tiny.model.config.name}/local")
        bad = pb.CaptionRequest(image_bytes=sample_image_bytes(), settings=spelled)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Caption(bad, timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "settings.adapter" in err.value.details() and "alone" in err.value.details()


def test_http_settings_adapter_and_variant(
    server: ServerThread, tiny: LoadedModel, folder: Path, sample_image: PreparedImage
) -> None:
    want = _reference(tiny, folder / "local" / "final.pt", "local")
    text = want.caption(sample_image, "normal", GREEDY).text
    image = data_url(sample_image_bytes())
    settings = {"temperature": 0, "max_tokens": 8}
    for extra in (
        {"settings": {**settings, "adapter": "local"}},
        {"settings": {**settings, "variant": "local"}},
        {"settings": settings, "variant": "local"},
    ):
        status, body = post_json(f"{server.http_url}/caption", {"image_url": image, **extra})
        assert status == 200 and body["caption"] == text, extra
    status, body = post_json(
        f"{server.http_url}/caption",
        {
            "image_url": image,
            "settings": settings,
            "variant": "local",
            "model": f"{tiny.model.config.name}/other@1",
        },
    )
    assert status == 400 and "model" in str(body)


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("other-model/local", "model"),  # a base the server does not serve
        ("moondream/other-model/local", "model"),
        ("{base}/", "model"),  # no id: never a silent base-model answer
        ("moondream/{base}/", "model"),
        ("{base}/@100", "model"),
        ("{base}/a/b", "model"),
        ("/", "model"),
        ("moondream/", "model"),
    ],
)
def test_a_model_naming_no_served_adapter_is_refused_by_both_routes(
    server: ServerThread, tiny: LoadedModel, model: str, field: str
) -> None:
    name = model.format(base=tiny.model.config.name)
    bodies = {
        "caption": {"image_url": data_url(sample_image_bytes()), "length": "short"},
        "chat/completions": {"messages": [{"role": "user", "content": "what?"}]},
    }
    for route, body in bodies.items():
        status, got = post_json(f"{server.http_url}/{route}", {**body, "model": name})
        assert status == 400 and got["error"]["field"] == field, (route, name, got)
        assert got["error"]["code"] == "INVALID_ARGUMENT"


def test_empty_adapter_fields_are_refused_and_plain_names_are_the_base_model(
    server: ServerThread, tiny: LoadedModel, sample_image: PreparedImage
) -> None:
    image = data_url(sample_image_bytes())
    settings = {"temperature": 0, "max_tokens": 8}
    for extra, field in (
        ({"variant": ""}, "variant"),
        ({"settings": {**settings, "adapter": ""}}, "settings.adapter"),
        ({"settings": {**settings, "variant": ""}}, "settings.variant"),
    ):
        status, got = post_json(f"{server.http_url}/caption", {"image_url": image, **extra})
        assert status == 400 and got["error"]["field"] == field, (extra, got)
    want = ReferenceGenerator(tiny.model, tiny.tokenizer).caption(sample_image, "normal", GREEDY)
    base = tiny.model.config.name
    # The served model by any of its names (the cloud's provider prefix too), or any name
    # without '/' (an OpenAI client's default): the base model.
    for model in (base, f"moondream/{base}", "gpt-4o", "moondream/moondream3-preview"):
        status, got = post_json(
            f"{server.http_url}/caption", {"image_url": image, "settings": settings, "model": model}
        )
        assert status == 200 and got["caption"] == want.text, (model, got)


def test_the_official_client_model_downloads_the_finetune(
    server: ServerThread,
    tiny: LoadedModel,
    folder: Path,
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache = getattr(pytestconfig, "cache", None)
    md: ModuleType = moondream_client(
        cache.mkdir("clients") if cache is not None else tmp_path_factory.mktemp("clients")
    )
    model = md.vl(endpoint=server.http_url, model=f"{tiny.model.config.name}/ft1@100")
    encoded = model.encode_image(Image.open(io.BytesIO(sample_image_bytes())))
    prepared = prepare_image(base64.b64decode(encoded.image_url.split(",", 1)[1]))
    got = model.caption(encoded, "normal", settings={"temperature": 0, "max_tokens": 8})
    # Downloaded with the key, into the folder where the reference caches it.
    assert ("/v1/variants/ft1@100/download", KEY) in _Variants.seen
    path = folder / "ft1@100" / "final.pt"
    assert (
        got["caption"] == _reference(tiny, path, "ft1@100").caption(prepared, "normal", GREEDY).text
    )
    # The OpenAI door takes the same model name; /v1/models lists it.
    status, body = post_json(
        f"{server.http_url}/chat/completions",
        {
            "model": f"{tiny.model.config.name}/ft1@100",
            "messages": [{"role": "user", "content": "what is this?"}],
            "max_tokens": 4,
        },
    )
    assert status == 200, body
    with __import__("urllib.request").request.urlopen(f"{server.http_url}/models") as r:
        ids = [m["id"] for m in __import__("json").loads(r.read())["data"]]
    assert any(i.endswith("/ft1@100") for i in ids)


@pytest.mark.parametrize(
    ("model", "status", "words"),
    [("junk@1", 400, "cannot read"), ("absent@2", 400, "HTTP 404")],
)
def test_a_failed_download_names_the_model_field(
    server: ServerThread, tiny: LoadedModel, model: str, status: int, words: str
) -> None:
    code, body = post_json(
        f"{server.http_url}/caption",
        {"image_url": data_url(sample_image_bytes()), "model": f"{tiny.model.config.name}/{model}"},
    )
    assert code == status and words in str(body) and "model" in str(body), body


def test_a_download_is_bounded_and_needs_the_key(endpoint: str, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, endpoint, api_key="wrong")
    with pytest.raises(files.AdapterError, match="HTTP 401"):
        store.path("ft1@100")
    small = AdapterStore(tmp_path, endpoint, api_key=KEY, max_bytes=100)
    with pytest.raises(files.AdapterError, match="exceeds 100 bytes"):
        small.path("ft1@100")
    assert not (tmp_path / "ft1@100" / "final.pt").exists()
    offline = AdapterStore(tmp_path, "http://127.0.0.1:9", api_key=KEY, timeout_s=2)
    with pytest.raises(files.AdapterError) as err:
        offline.path("ft1@100")
    assert err.value.retryable


def test_safetensors_and_plain_pt_layouts_read_alike(tiny: LoadedModel, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    targets = tiny.model.text.lora_targets
    state = random_state(targets, 2, seed=9)
    torch.save(state, tmp_path / "a.pt")
    save_file({files.rename(k): v for k, v in state.items()}, tmp_path / "b.safetensors")
    (tmp_path / "c").mkdir()
    save_file(state, tmp_path / "c" / "adapter.safetensors")
    loaded = [files.load(files.find(tmp_path, n), targets, 4, n) for n in "abc"]
    for w in loaded[1:]:
        for la, lb in zip(loaded[0].pairs, w.pairs, strict=True):
            assert all(torch.equal(la[t][i], lb[t][i]) for t in la for i in (0, 1))


@pytest.fixture(scope="module", autouse=True)
def _engine_process_server(
    request: pytest.FixtureRequest, tiny_dir: Path, folder: Path
) -> Iterator[ServerThread | None]:
    """The engine-process test's own server (no other test uses it), started with the module
    when that test is in the run: its engine process loads while the tests before it run."""
    yield from module_server(
        request,
        "test_adapters_through_the_engine_process",
        lambda: local_config(
            model=str(tiny_dir),
            device="cpu",
            dtype="fp32",
            kv_budget_bytes=16 * MIB,
            max_batch_size=4,
            engine_process="on",
            adapters_dir=str(folder),
            max_adapter_rank=RANK,
            max_adapters=2,
        ),
    )


def test_adapters_through_the_engine_process(
    tiny: LoadedModel,
    folder: Path,
    sample_image: PreparedImage,
    _engine_process_server: ServerThread | None,
) -> None:
    """The server's flags reach an engine in its own process: the adapter is loaded there
    (on its adapter threads), listed by GetModelInfo, and its errors cross with their field."""
    server = _engine_process_server
    assert server is not None and server.server is not None
    want = _reference(tiny, folder / "local" / "final.pt", "local")
    server.run(server.server.wait_ready())
    with VisionLanguageClient(server.target, timeout=60) as client:
        got = client.caption(sample_image_bytes(), temperature=0, max_tokens=8, adapter="local")
        assert got.text == want.caption(sample_image, "normal", GREEDY).text
        with pytest.raises(VlmError) as err:
            client.caption(sample_image_bytes(), max_tokens=4, adapter="missing")
        assert err.value.field == "settings.adapter"
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.VisionLanguageStub(channel)
            # The engine process reports a few times a second; the bound only stops a hang.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
                if info.adapters:
                    break
                time.sleep(0.1)
            assert [(a.id, a.rank) for a in info.adapters] == [("local", RANK)]
            assert info.limits.max_adapters == 2


def test_a_slow_download_delays_only_its_own_requests(
    server: ServerThread, tiny: LoadedModel
) -> None:
    """Two requests for a finetune being downloaded share one download; a request for the
    base model meanwhile is answered at once."""
    url = f"{server.http_url}/caption"
    image = data_url(sample_image_bytes())
    slow_body = {
        "image_url": image,
        "model": f"{tiny.model.config.name}/slow@7",
        "settings": {"max_tokens": 2},
    }
    done: dict[str, float] = {}

    def call(key: str, body: dict) -> None:
        status, _ = post_json(url, body)
        assert status == 200
        done[key] = time.monotonic()

    def downloads() -> int:
        return [p for p, _ in _Variants.seen].count("/v1/variants/slow@7/download")

    def in_flight() -> float:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            return value(response.read().decode(), "vlm_requests_in_flight", door="http")

    _Variants.slow_gate.clear()  # the download lasts until the base request was answered
    try:
        slow = [threading.Thread(target=call, args=(f"slow{i}", slow_body)) for i in range(2)]
        for t in slow:
            t.start()
        wait_for(lambda: downloads() == 1, what="the download to begin")
        wait_for(lambda: in_flight() == 2, what="both requests to arrive")
        call("base", {"image_url": image, "settings": {"max_tokens": 2}})
        assert "slow0" not in done and "slow1" not in done  # still waiting on the download
        released = time.monotonic()
    finally:
        _Variants.slow_gate.set()
    for t in slow:
        t.join(30)
    assert min(done["slow0"], done["slow1"]) >= released
    assert downloads() == 1


def test_a_slot_wait_past_its_bound_is_429_not_413() -> None:
    """Every slot busy is transient (retry), unlike a request that can never fit."""
    from vlm_server.engine.api import EngineError, ErrorCode
    from vlm_server.http.error_bodies import status_of

    busy = EngineError(ErrorCode.RESOURCE_EXHAUSTED, "adapter: no slot", "adapter")
    assert status_of(busy) == 429
    never = EngineError(ErrorCode.RESOURCE_EXHAUSTED, "max_tokens: too many", "max_tokens")
    assert status_of(never) == 413
