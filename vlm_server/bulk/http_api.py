"""The Batch API's routes on the HTTP door, as OpenAI's: ``/v1/files`` and ``/v1/batches``.

Every route is keyed: the API key is checked as the engine routes' is, and its holder owns
the files and batches it creates; another key's objects answer 404, as absent ones do (without
API keys, everything has one owner). Errors carry OpenAI's ``type`` and ``param`` besides the
server's ``code``, ``message`` and ``field``; a refused upload also names its ``line``. Without
``--data-dir`` every route answers 501 naming that option.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from vlm_server.bulk.lines import BATCH_URLS
from vlm_server.bulk.service import BatchApi
from vlm_server.bulk.store import INPUT_PURPOSE, BatchRecord, FileRecord, InUse, new_id, now
from vlm_server.bulk.uploads import (
    FILE_FIELD,
    InputFile,
    LineRefusal,
    receive,
    small_field,
    too_large,
)
from vlm_server.engine.api import ErrorCode
from vlm_server.frontend.refusals import invalid
from vlm_server.http.body import Field
from vlm_server.http.chat import error_style
from vlm_server.http.error_bodies import HttpError
from vlm_server.http.exchange import Exchange
from vlm_server.http.routes import Route

TAG = "batch"
COMPLETION_WINDOWS = ("24h",)
# OpenAI's bounds on the Batch API's metadata and pages (its clients expect no others).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_BATCH_PAGE, MAX_FILE_PAGE = 100, 10_000
_FORM_SLACK = 1 << 16  # bytes of a form beyond its file: boundaries, headers, the purpose
_PURPOSE_BYTES = 64
_FILENAME_CHARS = 255

CREATE_BATCH = (
    Field("input_file_id", "string", "An uploaded file (purpose batch).", required=True),
    Field(
        "endpoint",
        "string",
        "The route every line of the file names.",
        required=True,
        enum=BATCH_URLS,
    ),
    Field(
        "completion_window",
        "string",
        "Accepted for compatibility: batches here never expire, they run until done.",
        required=True,
        enum=COMPLETION_WINDOWS,
    ),
    Field(
        "metadata",
        "object",
        f"Up to {MAX_METADATA_PAIRS} string pairs, kept with the batch.",
        schema={"type": "object", "additionalProperties": {"type": "string"}},
    ),
    Field(
        "output_expires_after",
        "object",
        "An expiry of the output files.",
        unsupported="output files do not expire here (delete them with DELETE /v1/files/{id})",
    ),
)
_PAGE = (Field("after", "string", "The id of the last object of the previous page."),)
BATCH_QUERY = (
    Field("limit", "integer", f"Batches per page, 1 to {MAX_BATCH_PAGE} (default 20)."),
    *_PAGE,
)
FILE_QUERY = (
    Field("limit", "integer", f"Files per page, 1 to {MAX_FILE_PAGE} (default {MAX_FILE_PAGE})."),
    *_PAGE,
    Field("order", "string", "By creation: desc (default) or asc.", enum=("asc", "desc")),
    Field("purpose", "string", "Only files of this purpose (batch, batch_output)."),
)
UPLOAD_BODY = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["purpose", "file"],
            "properties": {
                "purpose": {"type": "string", "enum": [INPUT_PURPOSE]},
                "file": {
                    "type": "string",
                    "format": "binary",
                    "description": "JSONL, one request a line: {custom_id, method, url, body}",
                },
            },
        }
    }
}
FILE_OBJECT = {"type": "object", "description": "OpenAI's file object"}
BATCH_OBJECT = {"type": "object", "description": "OpenAI's batch object"}
LIST_OBJECT = {"type": "object", "description": "{object: list, data, first_id, last_id, has_more}"}


def _not_found(kind: str, field: str, value: str) -> HttpError:
    message = f"{field}: no such {kind} {value!r:.80}"
    return HttpError(404, ErrorCode.INVALID_ARGUMENT, message, field, name="NOT_FOUND")


def _conflict(field: str, message: str) -> HttpError:
    return HttpError(409, ErrorCode.INVALID_ARGUMENT, f"{field}: {message}", field, name="CONFLICT")


def _off() -> HttpError:
    message = (
        "the Batch API is off on this server: start it with --data-dir (a folder for its "
        "files and jobs)"
    )
    return HttpError(501, ErrorCode.UNIMPLEMENTED, message)


def _list(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def _limit(ex: Exchange, default: int, most: int) -> int:
    text = ex.request.query.get("limit")
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise invalid("limit", f"must be an integer from 1 to {most}, got {text!r:.20}")
    return value


def _metadata(value: dict[str, Any] | None) -> dict[str, str] | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise invalid("metadata", f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
    for key, item in value.items():
        path = f"metadata.{key:.64}"
        if len(key) > MAX_METADATA_KEY:
            raise invalid(path, f"keys are at most {MAX_METADATA_KEY} characters")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise invalid(path, f"must be a string of at most {MAX_METADATA_VALUE} characters")
    return value


Handler = Callable[[Exchange], Awaitable[web.StreamResponse]]


def routes(api: BatchApi | None) -> tuple[Route, ...]:
    """The routes of ``api`` (None: the Batch API is off, and they say so)."""

    def need() -> BatchApi:
        if api is None:
            raise _off()
        return api

    def styled(handler: Handler) -> Handler:
        async def run(ex: Exchange) -> web.StreamResponse:
            ex.error_style = error_style
            return await handler(ex)

        return run

    async def upload(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        limit = batch_api.max_file_bytes
        declared = ex.request.content_length
        if declared is not None and declared > limit + _FORM_SLACK:
            raise too_large(limit)
        temp = batch_api.data.upload()
        try:
            try:
                form = await _read_form(ex, temp, limit, batch_api.max_lines)
            except LineRefusal as err:
                answer = ex.error_body(err)
                answer["error"]["line"] = err.line
                return ex.respond(answer, err.status)
            purpose, received, filename = form
            record = FileRecord(
                new_id("file-"),
                ex.owner,
                purpose,
                filename,
                received.size,
                received.lines,
                now(),
                received.urls,
            )
            stored = batch_api.data.file(record.id)
            await asyncio.to_thread(temp.replace, stored)
            try:
                await batch_api.store.add_file(record)
            except BaseException:
                await asyncio.to_thread(stored.unlink, True)
                raise
        finally:
            await asyncio.to_thread(temp.unlink, True)
        return ex.respond(record.to_api())

    async def list_files(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        order = ex.request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", f"must be asc or desc, got {order!r:.20}")
        found, more = await batch_api.store.files(
            ex.owner,
            _limit(ex, MAX_FILE_PAGE, MAX_FILE_PAGE),
            ex.request.query.get("after"),
            ex.request.query.get("purpose"),
            ascending=order == "asc",
        )
        return ex.respond(_list([f.to_api() for f in found], more))

    async def owned_file(ex: Exchange) -> tuple[BatchApi, FileRecord]:
        batch_api = need()
        file_id = ex.request.match_info["file_id"]
        record = await batch_api.store.file(file_id, ex.owner)
        if record is None:
            raise _not_found("file", "file_id", file_id)
        return batch_api, record

    async def get_file(ex: Exchange) -> web.StreamResponse:
        _, record = await owned_file(ex)
        return ex.respond(record.to_api())

    async def file_content(ex: Exchange) -> web.StreamResponse:
        batch_api, record = await owned_file(ex)
        path = batch_api.data.file(record.id)
        if not await asyncio.to_thread(path.is_file):
            raise _not_found("file", "file_id", record.id)
        return web.FileResponse(
            path, headers={**ex.headers(), "Content-Type": "application/octet-stream"}
        )

    async def delete_file(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        file_id = ex.request.match_info["file_id"]
        try:
            record = await batch_api.store.delete_file(file_id, ex.owner)
        except InUse as err:
            raise _conflict("file_id", f"batch {err.batch_id} still reads it") from None
        if record is None:
            raise _not_found("file", "file_id", file_id)
        await asyncio.to_thread(batch_api.data.file(record.id).unlink, True)
        return ex.respond({"id": record.id, "object": "file", "deleted": True})

    async def create_batch(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        body = await ex.json(CREATE_BATCH)
        metadata = _metadata(body.get("metadata"))
        file_id, endpoint = body["input_file_id"], body["endpoint"]
        source = await batch_api.store.file(file_id, ex.owner)
        if source is None:
            raise _not_found("file", "input_file_id", file_id)
        if source.purpose != INPUT_PURPOSE:
            raise invalid("input_file_id", f"is a {source.purpose} file, not a batch input")
        for url, line in source.urls.items():
            if url != endpoint:
                raise invalid(
                    "endpoint",
                    f"is {endpoint}, but line {line} of {file_id} asks for {url}: every line "
                    "of a batch names its endpoint",
                )
        created = now()
        record = BatchRecord(
            new_id("batch_"),
            ex.owner,
            endpoint,
            file_id,
            body["completion_window"],
            "in_progress",
            created,
            source.lines,
            metadata=metadata,
            in_progress_at=created,
        )
        await batch_api.store.add_batch(record)
        if batch_api.jobs is not None:  # else it runs once the engine is ready
            batch_api.jobs.wake()
        return ex.respond(record.to_api())

    async def owned_batch(ex: Exchange) -> tuple[BatchApi, str, BatchRecord | None]:
        batch_api = need()
        batch_id = ex.request.match_info["batch_id"]
        return batch_api, batch_id, await batch_api.store.batch(batch_id, ex.owner)

    async def get_batch(ex: Exchange) -> web.StreamResponse:
        _, batch_id, record = await owned_batch(ex)
        if record is None:
            raise _not_found("batch", "batch_id", batch_id)
        return ex.respond(record.to_api())

    async def list_batches(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        limit = _limit(ex, 20, MAX_BATCH_PAGE)
        found, more = await batch_api.store.batches(ex.owner, limit, ex.request.query.get("after"))
        return ex.respond(_list([b.to_api() for b in found], more))

    async def cancel_batch(ex: Exchange) -> web.StreamResponse:
        batch_api = need()
        batch_id = ex.request.match_info["batch_id"]
        record = await batch_api.store.request_cancel(batch_id, ex.owner)
        if record is None:
            raise _not_found("batch", "batch_id", batch_id)
        if record.status not in ("cancelling", "cancelled"):
            raise _conflict("batch_id", f"the batch is {record.status}; it cannot be cancelled")
        if record.status == "cancelling" and batch_api.jobs is not None:
            batch_api.jobs.cancel(record)
        return ex.respond(record.to_api())

    def route(
        method: str, path: str, handler: Handler, summary: str, response: dict[str, Any], **kw: Any
    ) -> Route:
        return Route(
            method,
            path,
            styled(handler),
            summary,
            None,
            response=response,
            tag=TAG,
            keyed=True,
            **kw,
        )

    return (
        route(
            "POST",
            "/v1/files",
            upload,
            "Upload a batch input file (JSONL; every line checked)",
            FILE_OBJECT,
            body=UPLOAD_BODY,
        ),
        route("GET", "/v1/files", list_files, "Your files", LIST_OBJECT, query=FILE_QUERY),
        route("GET", "/v1/files/{file_id}", get_file, "One of your files", FILE_OBJECT),
        route(
            "DELETE",
            "/v1/files/{file_id}",
            delete_file,
            "Delete one of your files (not the input of an unfinished batch)",
            {"type": "object"},
        ),
        route(
            "GET",
            "/v1/files/{file_id}/content",
            file_content,
            "A file's bytes",
            {"type": "string", "format": "binary"},
            media="application/octet-stream",
        ),
        route(
            "POST",
            "/v1/batches",
            create_batch,
            "Run the lines of an input file as a batch",
            BATCH_OBJECT,
            request=CREATE_BATCH,
        ),
        route(
            "GET",
            "/v1/batches",
            list_batches,
            "Your batches, newest first",
            LIST_OBJECT,
            query=BATCH_QUERY,
        ),
        route("GET", "/v1/batches/{batch_id}", get_batch, "One of your batches", BATCH_OBJECT),
        route(
            "POST",
            "/v1/batches/{batch_id}/cancel",
            cancel_batch,
            "Cancel a batch: no more lines start, what is done is kept",
            BATCH_OBJECT,
        ),
    )


async def _read_form(
    ex: Exchange, temp: Path, limit: int, max_lines: int
) -> tuple[str, InputFile, str]:
    """(purpose, the received file, its name) of an upload's form."""
    try:
        reader = await ex.request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise invalid("body", "send multipart/form-data with the fields purpose and file") from None
    purpose: str | None = None
    received: InputFile | None = None
    filename = ""
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise invalid("body", "a nested multipart part; send purpose and file")
            if part.name == "purpose":
                purpose = await small_field(part, "purpose", _PURPOSE_BYTES)
            elif part.name == FILE_FIELD and received is None:
                filename = (part.filename or "input.jsonl")[:_FILENAME_CHARS]
                received = await receive(part, temp, limit, max_lines)
            else:
                raise invalid(str(part.name)[:64] or "body", "unknown or repeated form field")
    except (ValueError, HttpProcessingError) as err:  # a malformed form, or a part's headers
        # (LineRefusal and the checks above are EngineErrors, not these)
        why = getattr(err, "message", None) or err
        raise invalid("body", f"not a well-formed multipart form: {why!s:.200}") from None
    if purpose != INPUT_PURPOSE:
        raise invalid("purpose", f"must be {INPUT_PURPOSE}, got {purpose!r:.40}")
    if received is None:
        raise invalid(FILE_FIELD, "is required: the JSONL file of requests")
    return purpose, received, filename
