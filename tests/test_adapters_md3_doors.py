"""Moondream 3 finetunes through the doors: the official client's
``model="<served model>/<finetune_id>@<step>"`` over HTTP, downloaded from a local stand-in
of the cloud (the checkpoint's endpoint answers a presigned URL, fetched without the key), the
OpenAI door and /v1/models; failed downloads naming the client's field."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch
from PIL import Image

from image_pipeline import prepare_image, sample_image_bytes
from tests.http_support import data_url, moondream_client, post_json
from tests.support.http_files import QuietHandler
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import formats
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.store import AdapterStore
from vlm_server.models.lora.writer import random_finetune
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator, SamplingSettings

RANK = 6
KEY = "secret-key"
GREEDY = SamplingSettings(temperature=0.0, max_tokens=8)
API = "/v1/tuning/finetunes/"


class _Cloud(QuietHandler):
    """``/v1/tuning/finetunes/<id>/checkpoints/<step>/download`` answers (with the key) JSON
    ``{"url": <presigned>}``; ``/storage/...`` serves the checkpoint, as object storage does."""

    blobs: ClassVar[dict[str, bytes]] = {}
    answers: ClassVar[dict[str, object]] = {}  # finetunes whose answer is given here
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        auth = self.headers.get("X-Moondream-Auth")
        self.seen.append((self.path, auth))
        if self.path.startswith(API):
            finetune, _, rest = self.path.removeprefix(API).partition("/checkpoints/")
            step = rest.removesuffix("/download")
            name = f"{finetune}@{step}"
            if auth != KEY:
                self.send_error(401)
            elif name in self.answers:
                self.send_body(json.dumps(self.answers[name]).encode())
            elif name not in self.blobs:
                self.send_error(404)
            else:
                host = f"http://127.0.0.1:{self.server.server_address[1]}"
                url = f"{host}/storage/{finetune}/{step}/model.pt?X-Amz-Signature=abc"
                self.send_body(json.dumps({"url": url}).encode())
        elif self.path.startswith("/storage/"):
            finetune, step = self.path.split("?")[0].split("/")[2:4]
            self.send_body(self.blobs[f"{finetune}@{step}"])
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def md3_tiny() -> LoadedModel:
    return random_model(preset("md3-tiny"), seed=1, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def endpoint(md3_tiny: LoadedModel) -> Iterator[str]:
    buf = io.BytesIO()
    targets = md3_tiny.model.text.lora_targets
    torch.save(random_finetune(targets, RANK, seed=3, scale=0.4), buf)
    _Cloud.blobs = {"ft9@100": buf.getvalue(), "junk@1": b"not a checkpoint"}
    _Cloud.answers = {"nourl@1": {"error": "none"}, "local@2": {"url": "file:///etc/hosts"}}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Cloud)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("finetunes")


@pytest.fixture(scope="module")
def server(md3_tiny: LoadedModel, folder: Path, endpoint: str) -> Iterator[ServerThread]:
    config = EngineConfig(
        max_batch_size=4,
        kv_budget_bytes=16 << 20,
        adapters_dir=str(folder),
        adapter_endpoint=endpoint,
        adapter_api_key=KEY,
        max_adapter_rank=RANK,
    )
    with ServerThread(
        local_config(http_port=-1), in_process(lambda: BatchedEngine(md3_tiny, config))
    ) as s:
        yield s


def test_the_official_client_model_downloads_the_finetune(
    server: ServerThread,
    md3_tiny: LoadedModel,
    folder: Path,
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache = getattr(pytestconfig, "cache", None)
    md: ModuleType = moondream_client(
        cache.mkdir("clients") if cache is not None else tmp_path_factory.mktemp("clients")
    )
    model = md.vl(endpoint=server.http_url, model=f"{md3_tiny.model.config.name}/ft9@100")
    encoded = model.encode_image(Image.open(io.BytesIO(sample_image_bytes())))
    prepared = prepare_image(base64.b64decode(encoded.image_url.split(",", 1)[1]))
    got = model.caption(encoded, "normal", settings={"temperature": 0, "max_tokens": 8})
    # The checkpoint's URL with the key, then the presigned URL without it.
    paths = [(p.split("?")[0], auth) for p, auth in _Cloud.seen]
    assert (f"{API}ft9/checkpoints/100/download", KEY) in paths
    assert ("/storage/ft9/100/model.pt", None) in paths
    path = folder / "ft9@100" / "final.pt"
    weights = formats.load(path, md3_tiny.model.text.lora_targets, RANK, "ft9@100")
    want = ReferenceGenerator(md3_tiny.model, md3_tiny.tokenizer, weights)
    assert got["caption"] == want.caption(prepared, "normal", GREEDY).text
    base = ReferenceGenerator(md3_tiny.model, md3_tiny.tokenizer)
    assert got["caption"] != base.caption(prepared, "normal", GREEDY).text
    # The OpenAI door takes the same model name; /v1/models lists it.
    status, body = post_json(
        f"{server.http_url}/chat/completions",
        {
            "model": f"{md3_tiny.model.config.name}/ft9@100",
            "messages": [{"role": "user", "content": "what is this?"}],
            "max_tokens": 4,
        },
    )
    assert status == 200, body
    with urllib.request.urlopen(f"{server.http_url}/models") as r:
        ids = [m["id"] for m in json.loads(r.read())["data"]]
    assert any(i.endswith("/ft9@100") for i in ids)


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("junk@1", "cannot read"),
        ("absent@2", "HTTP 404"),
        ("nourl@1", "holds no download url"),
        ("local@2", "holds no download url"),
        ("nostep", "named <finetune_id>@<step>"),
    ],
)
def test_a_failed_download_names_the_model_field(
    server: ServerThread, md3_tiny: LoadedModel, model: str, words: str
) -> None:
    code, body = post_json(
        f"{server.http_url}/caption",
        {
            "image_url": data_url(sample_image_bytes()),
            "model": f"{md3_tiny.model.config.name}/{model}",
        },
    )
    assert code == 400 and words in str(body) and "model" in str(body), body


def test_a_download_needs_the_key_and_is_bounded(endpoint: str, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path, endpoint, api_key="wrong", scheme="finetune")
    with pytest.raises(AdapterError, match="HTTP 401"):
        store.path("ft9@100")
    small = AdapterStore(tmp_path, endpoint, api_key=KEY, max_bytes=100, scheme="finetune")
    with pytest.raises(AdapterError, match="exceeds 100 bytes"):
        small.path("ft9@100")
    assert not (tmp_path / "ft9@100" / "final.pt").exists()
    offline = AdapterStore(tmp_path, "http://127.0.0.1:9", api_key=KEY, timeout_s=2)
    offline.scheme = "finetune"
    with pytest.raises(AdapterError) as err:
        offline.path("ft9@100")
    assert err.value.retryable
    fine = AdapterStore(tmp_path, endpoint, api_key=KEY, scheme="finetune")
    assert fine.path("ft9@100") == tmp_path / "ft9@100" / "final.pt"
    assert torch.load(fine.path("ft9@100"), weights_only=True).keys() == {"lora_state_dict"}
