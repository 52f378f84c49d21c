"""The Batch API with the official ``openai`` client, unmodified (tiny model, a real SQLite
database and real files): a batch runs to its output and error files with the same answers
as the routes give, uploads are refused naming the bad line and field, one API key never
sees another's files or batches, a cancel keeps what is done, lists page with limit/after,
and without --data-dir the routes say how to turn the API on."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.service_harness import (
    GatedBatchedEngine,
    ServerThread,
    engine_of,
    in_process,
    local_config,
    wait_for,
)
from vlm_server.bulk.service import BatchApi
from vlm_server.bulk.store import SCHEMA_VERSION, Store
from vlm_server.engine.config import EngineConfig
from vlm_server.models.interface import LoadedModel

openai = pytest.importorskip("openai")

MIB = 1 << 20
KEYS = ("key-alice", "key-bob")
IMG = data_url(sample_image_bytes())
FILE_LIMIT = 1 << 20
LINE_LIMIT = 20
CONCURRENCY = 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-data")


@pytest.fixture(scope="module")
def server(tiny: LoadedModel, data_dir: Path) -> Iterator[ServerThread]:
    engine = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    config = local_config(
        http_port=-1,
        api_keys=KEYS,
        data_dir=str(data_dir),
        batch_concurrency=CONCURRENCY,
        max_batch_file_bytes=FILE_LIMIT,
        max_batch_lines=LINE_LIMIT,
    )
    with ServerThread(config, in_process(lambda: GatedBatchedEngine(tiny, engine))) as running:
        yield running


def _client(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def alice(server: ServerThread) -> Iterator[openai.OpenAI]:
    with _client(server, KEYS[0]) as client:
        yield client


@pytest.fixture(scope="module")
def bob(server: ServerThread) -> Iterator[openai.OpenAI]:
    with _client(server, KEYS[1]) as client:
        yield client


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _chat(question: str, max_tokens: int = 6) -> dict[str, Any]:
    content = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": IMG}}]
    return {
        "model": "moondream",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def _caption(max_tokens: int = 4) -> dict[str, Any]:
    return {"image_url": IMG, "settings": {"temperature": 0, "max_tokens": max_tokens}}


def _upload(client: openai.OpenAI, lines: list[Any]) -> Any:
    return client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")


def _start(client: openai.OpenAI, lines: list[Any], endpoint: str) -> Any:
    source = _upload(client, lines)
    return client.batches.create(
        input_file_id=source.id, endpoint=endpoint, completion_window="24h"
    )


def _until(client: openai.OpenAI, batch_id: str, *statuses: str) -> Any:
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout=60,
        what=f"batch {batch_id} to be {' or '.join(statuses)}",
    )


def _results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    found = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in found}
    assert len(by_id) == len(found), "a custom_id twice"
    return by_id


def test_the_openai_client_runs_a_batch(
    server: ServerThread, alice: openai.OpenAI, data_dir: Path
) -> None:
    questions = [f"what is in picture {i}?" for i in range(5)]
    lines = [_line(f"q{i}", "/v1/chat/completions", _chat(q)) for i, q in enumerate(questions)]
    lines.append(_line("no-messages", "/v1/chat/completions", {"messages": []}))
    source = _upload(alice, lines)
    assert source.purpose == "batch" and source.bytes == len(_jsonl(lines))
    assert alice.files.retrieve(source.id).filename == "requests.jsonl"
    assert alice.files.content(source.id).content == _jsonl(lines)
    created = alice.batches.create(
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert created.object == "batch" and created.status == "in_progress"
    assert created.request_counts is not None and created.request_counts.total == 6
    done = _until(alice, created.id, "completed", "failed")
    assert done.status == "completed", done.errors
    assert done.request_counts.completed == 5 and done.request_counts.failed == 1
    assert done.metadata == {"job": "nightly"} and done.completed_at is not None
    assert done.in_progress_at <= done.finalizing_at <= done.completed_at
    output = _results(alice, done.output_file_id)
    errors = _results(alice, done.error_file_id)
    assert sorted(output) == [f"q{i}" for i in range(5)] and list(errors) == ["no-messages"]
    for i, question in enumerate(questions):
        status, direct = post_json(
            f"{server.http_url}/chat/completions",
            _chat(question),
            headers={"Authorization": f"Bearer {KEYS[0]}"},
        )
        response = output[f"q{i}"]["response"]
        assert status == response["status_code"] == 200
        got = response["body"]["choices"][0]["message"]["content"]
        assert got == direct["choices"][0]["message"]["content"]
    refused = errors["no-messages"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "messages"
    for file_id in (done.output_file_id, done.error_file_id):
        assert alice.files.retrieve(file_id).purpose == "batch_output"
    # The database and the folder hold it all; the results file is gone once finalized.
    with sqlite3.connect(data_dir / "batches.sqlite3") as db:
        (row,) = db.execute(
            "SELECT status, completed, failed FROM batches WHERE id = ?", (done.id,)
        )
        assert row == ("completed", 5, 1)
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    results = data_dir / "results" / f"{done.id}.jsonl"
    wait_for(lambda: not results.exists(), what="the results file to go after the commit")
    assert (data_dir / "files" / done.output_file_id).is_file()


def _refusal(client: openai.OpenAI, data: bytes, purpose: str = "batch") -> tuple[int, Any]:
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("bad.jsonl", data), purpose=purpose)  # type: ignore[arg-type]
    return caught.value.status_code, caught.value.body


GOOD = _line("ok", "/v1/caption", _caption())
HI = {"question": "hi", "settings": {"temperature": 0, "max_tokens": 4}}


@pytest.mark.parametrize(
    ("lines", "line", "field", "words"),
    [
        ([GOOD, "not json"], 2, "line", "not JSON"),
        ([GOOD, GOOD], 2, "custom_id", "repeats line 1"),
        ([GOOD, "", {**GOOD, "custom_id": "x", "url": "/v1/nowhere"}], 3, "url", "one of"),
        ([{**GOOD, "method": "GET"}], 1, "method", "POST"),
        ([{"custom_id": "a", "url": "/v1/caption"}], 1, "body", "required"),
        ([{**GOOD, "body": {**_caption(), "stream": True}}], 1, "body", "stream"),
        ([{**GOOD, "extra": 1}], 1, "extra", "not a member"),
    ],
)
def test_an_upload_is_refused_naming_the_first_bad_line_and_field(
    alice: openai.OpenAI,
    data_dir: Path,
    lines: list[Any],
    line: int,
    field: str,
    words: str,
) -> None:
    before = sorted(p.name for p in (data_dir / "files").iterdir())
    status, error = _refusal(alice, _jsonl(lines))
    assert status == 400
    assert (error["line"], error["param"], error["field"]) == (line, field, field)
    assert error["message"].startswith(f"line {line}: ") and words in error["message"]
    assert sorted(p.name for p in (data_dir / "files").iterdir()) == before  # nothing kept


def test_a_form_or_file_out_of_bounds_is_refused(alice: openai.OpenAI) -> None:
    status, error = _refusal(alice, b"\n\n")
    assert status == 400 and error["param"] == "file" and "no request lines" in error["message"]
    status, error = _refusal(alice, _jsonl([GOOD]), purpose="fine-tune")
    assert status == 400 and error["param"] == "purpose"
    status, error = _refusal(alice, b"\xff\n")
    assert status == 400 and error["line"] == 1 and "UTF-8" in error["message"]
    padding = _line("big", "/v1/query", {"question": "x" * FILE_LIMIT})
    status, error = _refusal(alice, _jsonl([GOOD, padding]))
    assert status == 413 and "max_batch_file_bytes" in error["message"]
    many = [_line(f"m{i}", "/v1/query", HI) for i in range(LINE_LIMIT + 1)]
    status, error = _refusal(alice, _jsonl(many))
    assert status == 413 and "max_batch_lines" in error["message"]
    assert _upload(alice, many[:LINE_LIMIT]).purpose == "batch"


def test_a_second_server_cannot_take_the_data_dir(server: ServerThread, data_dir: Path) -> None:
    with pytest.raises(ValueError, match="in use by another server"):
        asyncio.run(BatchApi(data_dir, FILE_LIMIT, LINE_LIMIT, 1).open())


def test_a_batch_is_checked_against_its_input(alice: openai.OpenAI, bob: openai.OpenAI) -> None:
    source = _upload(alice, [GOOD, _line("q", "/v1/query", HI)])
    with pytest.raises(openai.BadRequestError) as caught:
        alice.batches.create(
            input_file_id=source.id, endpoint="/v1/caption", completion_window="24h"
        )
    error = caught.value.body
    assert error["param"] == "endpoint" and "line 2" in error["message"]
    with pytest.raises(openai.NotFoundError):
        alice.batches.create(
            input_file_id="file-none", endpoint="/v1/caption", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError) as caught:
        alice.batches.create(
            input_file_id=source.id, endpoint="/v1/caption", completion_window="48h"
        )  # type: ignore[arg-type]
    assert caught.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as caught:
        alice.batches.create(
            input_file_id=source.id,
            endpoint="/v1/caption",
            completion_window="24h",
            metadata={"k": "v" * 513},
        )
    assert caught.value.body["param"] == "metadata.k"
    done = _until(alice, _start(alice, [GOOD], "/v1/caption").id, "completed")
    with pytest.raises(openai.BadRequestError) as caught:  # an output file is no input
        alice.batches.create(
            input_file_id=done.output_file_id, endpoint="/v1/caption", completion_window="24h"
        )
    assert caught.value.body["param"] == "input_file_id"


def test_one_key_never_sees_another_keys_files_or_batches(
    server: ServerThread, alice: openai.OpenAI, bob: openai.OpenAI
) -> None:
    batch = _start(alice, [_line("a", "/v1/caption", _caption())], "/v1/caption")
    done = _until(alice, batch.id, "completed")
    for attempt in (
        lambda: bob.files.retrieve(batch.input_file_id),
        lambda: bob.files.content(batch.input_file_id),
        lambda: bob.files.content(done.output_file_id),
        lambda: bob.files.delete(batch.input_file_id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(
            input_file_id=batch.input_file_id, endpoint="/v1/caption", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in {b.id for b in bob.batches.list()}
    assert not {batch.input_file_id, done.output_file_id} & {f.id for f in bob.files.list()}
    assert list(bob.batches.list(after=batch.id)) == []  # another's cursor starts nowhere
    assert batch.id in {b.id for b in alice.batches.list()}
    # Without a key, or with a wrong one: 401 before anything is read.
    for key in ("", "key-mallory"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(f"{server.http_url}/batches/{batch.id}", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 401
    # Deleting: refused while a batch reads the file, and the owner's own works.
    alice.files.delete(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(done.output_file_id)


def test_a_cancel_keeps_the_lines_done_and_starts_no_more(
    server: ServerThread, alice: openai.OpenAI
) -> None:
    engine = engine_of(server)
    assert isinstance(engine, GatedBatchedEngine)
    n = 12
    story = {"question": "a story", "settings": {"temperature": 0, "max_tokens": 8}}
    lines = [_line(f"c{i}", "/v1/query", story) for i in range(n)]
    engine.token_gate.clear()
    try:
        batch = _start(alice, lines, "/v1/query")
        wait_for(engine.holding.is_set, what="the batch's first lines to decode")
        with pytest.raises(openai.ConflictError):  # its input is read
            alice.files.delete(batch.input_file_id)
        cancelling = alice.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    finally:
        engine.token_gate.set()
    done = _until(alice, batch.id, "cancelled")
    assert done.cancelled_at is not None and done.completed_at is None
    output = _results(alice, done.output_file_id)
    # The lines in flight at the cancel finished; none started after it.
    assert 1 <= len(output) <= CONCURRENCY and done.error_file_id is None
    assert done.request_counts.completed == len(output) and done.request_counts.failed == 0
    assert set(output) <= {f"c{i}" for i in range(n)}
    assert alice.batches.cancel(batch.id).status == "cancelled"  # again: as it is
    with pytest.raises(openai.ConflictError):  # a completed batch cannot be cancelled
        alice.batches.cancel(_until(alice, _start(alice, [GOOD], "/v1/caption").id, "completed").id)
    alice.files.delete(batch.input_file_id)  # no batch reads it any more


def test_batches_list_newest_first_with_limit_and_after(
    alice: openai.OpenAI, bob: openai.OpenAI
) -> None:
    made = [_start(bob, [_line(f"l{i}", "/v1/query", HI)], "/v1/query") for i in range(3)]
    newest_first = [b.id for b in reversed(made)]
    page = bob.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    rest = bob.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == newest_first[2:3] and not rest.has_more
    assert [b.id for b in bob.batches.list(limit=1)] == newest_first  # the client pages on
    with pytest.raises(openai.BadRequestError) as caught:
        bob.batches.list(limit=0)
    assert caught.value.body["param"] == "limit"
    files = bob.files.list(order="asc", purpose="batch")
    assert [f.id for f in files] == [b.input_file_id for b in made]
    for batch in made:
        _until(bob, batch.id, "completed")


def test_the_routes_are_described(server: ServerThread) -> None:
    with urllib.request.urlopen(server.http_url.removesuffix("/v1") + "/openapi.json") as r:
        document = json.loads(r.read())
    paths = document["paths"]
    assert set(paths["/v1/files/{file_id}"]) == {"get", "delete"}
    assert paths["/v1/batches/{batch_id}/cancel"]["post"]["parameters"][0]["name"] == "batch_id"
    upload = paths["/v1/files"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]
    assert {"401", "404", "413"} <= set(upload["responses"])
    assert {p["name"] for p in paths["/v1/batches"]["get"]["parameters"]} == {"limit", "after"}


def test_without_a_data_dir_the_batch_api_names_the_option(tiny: LoadedModel) -> None:
    engine = EngineConfig(max_batch_size=2, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: GatedBatchedEngine(tiny, engine))
    with (
        ServerThread(local_config(http_port=-1), factory) as plain,
        openai.OpenAI(base_url=plain.http_url, api_key="k", max_retries=0) as client,
    ):
        for attempt in (
            lambda: client.files.create(file=("a.jsonl", _jsonl([GOOD])), purpose="batch"),
            lambda: client.batches.list(),
            lambda: client.batches.retrieve("batch_x"),
        ):
            with pytest.raises(openai.APIStatusError) as caught:
                attempt()
            assert caught.value.status_code == 501
            assert "--data-dir" in caught.value.body["message"]


def test_a_database_of_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "batches.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    store = Store(path)

    async def open_it() -> None:
        try:
            await store.open()
        finally:
            await store.close()

    with pytest.raises(ValueError, match=r"data_dir: .* newer"):
        asyncio.run(open_it())
