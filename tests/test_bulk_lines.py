"""Batch lines through the HTTP door's own routes (tiny model, batched engine): the same
answers as the same bodies posted, error lines naming their cause, results written once and a
torn results file repaired, progress counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from image_pipeline import sample_image_bytes
from tests.http_support import data_url, post_json
from tests.support.service_harness import ServerThread, in_process, local_config
from vlm_server.bulk import lines
from vlm_server.bulk.executor import LineRunner
from vlm_server.bulk.lines import BatchRequest, LineError, parse_line
from vlm_server.bulk.results import ResultLog, read_results
from vlm_server.bulk.runner import Item, Progress, run_batch
from vlm_server.engine.api import BATCH_PRIORITY
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel

MIB = 1 << 20
IMAGE = data_url(sample_image_bytes())
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(tiny: LoadedModel) -> Iterator[ServerThread]:
    config = EngineConfig(max_batch_size=8, max_queue=100, kv_budget_bytes=16 * MIB)
    factory = in_process(lambda: BatchedEngine(tiny, config))
    with ServerThread(local_config(http_port=-1), factory) as running:
        yield running


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def _items(texts: list[str]) -> AsyncIterator[Item]:
    for text in texts:
        try:
            yield parse_line(text)
        except LineError as err:
            yield (lines.custom_id_of(text) or "?", err)


def _run(server: ServerThread, texts: list[str], out: Path, concurrency: int = 4) -> Progress:
    assert server.server is not None
    runner = LineRunner(server.server.core)

    async def go() -> Progress:
        with ResultLog(out) as log:
            return await run_batch(_items(texts), runner, log, concurrency)

    return server.run(go())


def _strip(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("request_id", "metrics")}


BODIES = [
    ("/v1/caption", {"image_url": IMAGE, "length": "short", "settings": GREEDY}),
    ("/v1/query", {"image_url": IMAGE, "question": "what?", "settings": GREEDY}),
    ("/v1/point", {"image_url": IMAGE, "object": "dog", "settings": {"max_objects": 3}}),
    ("/v1/detect", {"image_url": IMAGE, "object": "dog", "settings": {"max_objects": 3}}),
]


def test_lines_answer_as_the_routes_do(server: ServerThread, tmp_path: Path) -> None:
    texts = [_line(f"r{i}", url, body) for i, (url, body) in enumerate(BODIES)]
    progress = _run(server, texts, tmp_path / "out.jsonl")
    assert (progress.completed, progress.failed, progress.skipped) == (len(BODIES), 0, 0)
    got = {r["custom_id"]: r for r in read_results(tmp_path / "out.jsonl")}
    assert sorted(got) == [f"r{i}" for i in range(len(BODIES))]
    for i, (url, body) in enumerate(BODIES):
        status, posted = post_json(server.http_url.removesuffix("/v1") + url, body)
        line = got[f"r{i}"]
        assert line["error"] is None and line["response"]["status_code"] == status == 200
        assert _strip(line["response"]["body"]) == _strip(posted), url
        assert lines.succeeded(line)


def test_bad_lines_become_error_lines_and_the_rest_goes_on(
    server: ServerThread, tmp_path: Path
) -> None:
    texts = [
        "not json",
        _line("bad-url", "/v1/nowhere", {}),
        json.dumps({"custom_id": "no-body", "url": "/v1/caption"}),
        _line("streams", "/v1/caption", {"image_url": IMAGE, "stream": True}),
        _line("bad-image", "/v1/caption", {"image_url": "data:image/jpeg;base64,AAAA"}),
        _line("bad-field", "/v1/detect", {"image_url": IMAGE, "object": "x", "colour": 1}),
        _line("good", "/v1/caption", {"image_url": IMAGE, "settings": GREEDY}),
    ]
    progress = _run(server, texts, tmp_path / "out.jsonl")
    got = {r["custom_id"]: r for r in read_results(tmp_path / "out.jsonl")}
    assert progress.completed == 1 and progress.failed == len(texts) - 1
    assert got["?"]["error"]["field"] == "line"
    assert got["bad-url"]["error"]["field"] == "url"
    assert got["no-body"]["error"]["field"] == "body"
    assert "stream" in got["streams"]["error"]["message"]
    image = got["bad-image"]["response"]
    assert image["status_code"] == 400 and image["body"]["error"]["field"] == "image_url"
    extra = got["bad-field"]["response"]
    assert extra["status_code"] == 400 and extra["body"]["error"]["field"] == "colour"
    assert lines.succeeded(got["good"])
    assert not any(lines.succeeded(got[k]) for k in got if k != "good")


def test_a_second_run_skips_what_is_written_and_repairs_a_torn_tail(
    server: ServerThread, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    body = {"image_url": IMAGE, "length": "short", "settings": GREEDY}
    texts = [_line(f"c{i}", "/v1/caption", body) for i in range(6)]
    first = _run(server, texts[:3], out)
    assert first.completed == 3
    with out.open("ab") as f:  # a writer killed mid-line
        f.write(b'{"id":"batch_req_x","custom_id":"c3","resp')
    second = _run(server, texts, out, concurrency=2)
    assert (second.skipped, second.completed) == (3, 3)
    ids = [r["custom_id"] for r in read_results(out)]
    assert sorted(ids) == [f"c{i}" for i in range(6)] and len(ids) == len(set(ids))
    assert out.read_bytes().endswith(b"\n")
    third = _run(server, texts, out)
    assert (third.skipped, third.completed) == (6, 0)


def test_a_stop_ends_the_batch_with_the_rest_unwritten(
    server: ServerThread, tmp_path: Path
) -> None:
    assert server.server is not None
    runner = LineRunner(server.server.core)
    body = {"image_url": IMAGE, "settings": {"temperature": 0, "max_tokens": 4}}
    texts = [_line(f"s{i}", "/v1/caption", body) for i in range(20)]
    out = tmp_path / "out.jsonl"

    async def go() -> Progress:
        stop = asyncio.Event()

        def on_progress(p: Progress) -> None:
            if p.completed >= 2:
                stop.set()

        with ResultLog(out) as log:
            return await run_batch(
                _items(texts), runner, log, 2, on_progress=on_progress, stop=stop
            )

    progress = server.run(go())
    assert progress.interrupted
    written = [r["custom_id"] for r in read_results(out)]
    assert 2 <= len(written) < len(texts) and len(written) == len(set(written))
    rest = _run(server, texts, out)
    assert rest.skipped == len(written) and rest.completed == len(texts) - len(written)


def test_lines_are_checked_field_by_field() -> None:
    ok = parse_line(_line("a", "/v1/query", {"question": "hi"}))
    assert ok == BatchRequest("a", "/v1/query", {"question": "hi"})
    for text, field in [
        ("[]", "line"),
        (json.dumps({"url": "/v1/query", "body": {}}), "custom_id"),
        (json.dumps({"custom_id": "", "url": "/v1/query", "body": {}}), "custom_id"),
        (json.dumps({"custom_id": "x" * 513, "url": "/v1/query", "body": {}}), "custom_id"),
        (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/query", "body": {}}), "method"),
        (json.dumps({"custom_id": "a", "url": "/v1/query", "body": []}), "body"),
        (json.dumps({"custom_id": "a", "url": "/v1/query", "body": {}, "x": 1}), "x"),
    ]:
        with pytest.raises(LineError) as caught:
            parse_line(text)
        assert caught.value.field == field, text


def test_a_results_file_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "other.jsonl"
    out.write_text('{"not": "a result"}\n')
    with pytest.raises(ValueError, match="not a result line"):
        ResultLog(out).open()
    request = _line("a", "/v1/caption", {"image_url": IMAGE})  # the input, as the output
    out.write_text(request + "\n")
    with pytest.raises(ValueError, match="not a result line"):
        ResultLog(out).open()
    assert out.read_text() == request + "\n"


def test_a_runner_with_a_priority_submits_every_line_at_it(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.server is not None and server.server.core.engine is not None
    engine = server.server.core.engine
    seen: list[int] = []
    submit = engine.submit

    async def recording(request: Any) -> Any:
        seen.append(request.priority)
        return await submit(request)

    monkeypatch.setattr(engine, "submit", recording)
    body = {"image_url": IMAGE, "priority": 7, "settings": GREEDY}
    line = BatchRequest("p", "/v1/caption", body)
    for priority, expected in ((BATCH_PRIORITY, BATCH_PRIORITY), (None, 7)):
        status, _, _ = server.run(LineRunner(server.server.core, priority).run(line))
        assert status == 200 and seen[-1] == expected
