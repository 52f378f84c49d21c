"""The Batch API under generated input: batch creations changed from one the server takes,
uploads of generated forms and files (purposes, file names, lines valid and not, bytes that
are no text), page queries and object ids of any text. Nothing gets a 5xx: every refusal is a
4xx with an error message, every answer a 2xx, both occur. Afterwards the server is healthy
and every batch it took ends. Examples are derandomized: the same input every run."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http_support import post
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from tests.test_http_fuzz import any_json, changed_body
from vlm_server.bulk.http_api import CREATE_BATCH
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/query",
    "body": {"question": "hi?", "settings": {"max_tokens": 2}},
}
ids = st.text(max_size=12) | st.sampled_from(["file-x", "batch_x", "..", "%2e%2e", "a/b"])


@pytest.fixture(scope="module")
def server(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    data = tmp_path_factory.mktemp("batch-fuzz")
    engine = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 << 20)
    config = local_config(
        http_port=-1, data_dir=str(data), max_batch_file_bytes=64 << 10, max_batch_lines=20
    )
    with ServerThread(config, in_process(lambda: GatedBatchedEngine(tiny, engine))) as running:
        yield running


def _root(server: ServerThread) -> str:
    return server.http_url.removesuffix("/v1")


def _request(method: str, url: str, data: bytes | None = None, headers: dict | None = None):
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _form(purpose: Any, filename: str, content: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = []
    if purpose is not None:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            f"{purpose}\r\n".encode()
        )
    name = filename.replace('"', "").replace("\r", "").replace("\n", "")
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n".encode()
        + content
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), boundary


def _upload(server: ServerThread, purpose: Any, filename: str, content: bytes):
    body, boundary = _form(purpose, filename, content)
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    return _request("POST", _root(server) + "/v1/files", body, headers)


def _checked(status: int, raw: bytes, seen: dict[int, int], what: object) -> None:
    seen[status] = seen.get(status, 0) + 1
    assert status < 500, (what, raw[:300])
    if status >= 400:
        assert json.loads(raw)["error"]["message"], (what, raw[:300])


lines = st.lists(
    st.one_of(
        st.just(json.dumps(LINE)),
        st.builds(lambda cid: json.dumps({**LINE, "custom_id": cid}), st.text(max_size=8)),
        any_json.map(json.dumps),
        st.text(max_size=20),
    ),
    max_size=4,
)


def test_generated_uploads_get_a_4xx_or_a_file(server: ServerThread) -> None:
    seen: dict[int, int] = {}

    valid = st.tuples(st.just("batch"), st.just("in.jsonl"), st.just(json.dumps(LINE).encode()))
    generated = st.tuples(
        st.sampled_from(["batch", None, "fine-tune", ""]) | st.text(max_size=10),
        st.sampled_from(["in.jsonl"]) | st.text(max_size=12),
        lines.map(lambda ls: "\n".join(ls).encode()) | st.binary(max_size=40),
    )

    @FUZZ
    @given(form=valid | generated | generated)
    def check(form: tuple[Any, str, bytes]) -> None:
        purpose, filename, content = form
        status, raw = _upload(server, purpose, filename, content)
        _checked(status, raw, seen, (purpose, filename, content))

    check()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen


def test_a_part_header_that_does_not_parse_is_a_400_naming_the_body(server: ServerThread) -> None:
    status, raw = _upload(server, "batch", "in\x08.jsonl", json.dumps(LINE).encode())
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "body" and "not a well-formed multipart form" in error["message"]


def test_generated_batch_creations_get_a_4xx_or_a_batch(server: ServerThread) -> None:
    status, raw = _upload(server, "batch", "in.jsonl", json.dumps(LINE).encode())
    assert status == 200, raw
    valid = {
        "input_file_id": json.loads(raw)["id"],
        "endpoint": "/v1/query",
        "completion_window": "24h",
    }
    seen: dict[int, int] = {}

    @FUZZ
    @given(body=changed_body(valid, CREATE_BATCH) | any_json)
    def check(body: Any) -> None:
        status, _, raw = post(_root(server) + "/v1/batches", body)
        _checked(status, raw, seen, body)

    check()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen


def test_generated_pages_and_ids_get_a_4xx_or_an_answer(server: ServerThread) -> None:
    seen: dict[int, int] = {}
    root = _root(server)

    @FUZZ
    @given(
        route=st.sampled_from(
            [
                ("GET", "/v1/files/{}"),
                ("DELETE", "/v1/files/{}"),
                ("GET", "/v1/files/{}/content"),
                ("GET", "/v1/batches/{}"),
                ("POST", "/v1/batches/{}/cancel"),
                ("GET", "/v1/files?{}"),
                ("GET", "/v1/batches?{}"),
            ]
        ),
        key=ids,
        query=st.dictionaries(
            st.sampled_from(["limit", "after", "order", "purpose", "x"]),
            st.integers(min_value=-5, max_value=20_000).map(str) | ids,
            max_size=3,
        ),
    )
    def check(route: tuple[str, str], key: str, query: dict[str, str]) -> None:
        method, path = route
        fill = urllib.parse.urlencode(query) if "?" in path else urllib.parse.quote(key, safe="")
        status, raw = _request(method, root + path.format(fill))
        _checked(status, raw, seen, (method, path, key, query))

    check()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen


def test_the_server_is_healthy_and_its_batches_end(server: ServerThread) -> None:
    root = _root(server)
    assert _request("GET", root + "/health")[0] == 200

    def ended() -> bool:
        status, raw = _request("GET", root + "/v1/batches?limit=100")
        assert status == 200
        return all(
            b["status"] in ("completed", "failed", "cancelled", "expired")
            for b in json.loads(raw)["data"]
        )

    wait_for(ended, what="every batch to end")
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    wait_for(engine.idle, what="an idle engine")
