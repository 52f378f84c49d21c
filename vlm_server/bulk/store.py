"""The Batch API's state: files and batches in SQLite, their bytes in the data dir.

``<data-dir>/batches.sqlite3`` holds a row per file and per batch (owner, status, counts,
timestamps, file ids); ``files/`` the bytes of every file (uploads, outputs) under its id;
``results/`` one results file per running batch (`ResultLog`: the truth of which lines are
done). The database runs in WAL mode on one connection that only its own worker thread
touches, so no query ever runs on the event loop; a process killed at any point leaves the
last committed state. ``PRAGMA user_version`` is the schema's version: `_MIGRATIONS` takes a
database from each version to the next, and a database of a newer version is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA_VERSION = 1
# Each script takes the database from version i to i + 1 (index i).
_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT NOT NULL,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        lines INTEGER NOT NULL,
        urls TEXT NOT NULL,
        created_at INTEGER NOT NULL
    );
    CREATE INDEX files_by_owner ON files (owner, seq);
    CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        metadata TEXT,
        errors TEXT,
        total INTEGER NOT NULL,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        output_file_id TEXT,
        error_file_id TEXT,
        created_at INTEGER NOT NULL,
        in_progress_at INTEGER,
        finalizing_at INTEGER,
        completed_at INTEGER,
        failed_at INTEGER,
        cancelling_at INTEGER,
        cancelled_at INTEGER
    );
    CREATE INDEX batches_by_owner ON batches (owner, seq);
    CREATE INDEX batches_by_status ON batches (status, seq);
    """,
)

# A batch in one of these has work left: the job manager runs or finalizes it.
ACTIVE = ("in_progress", "finalizing", "cancelling")
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class DataDir:
    """Where everything of ``--data-dir`` lives."""

    root: Path

    @property
    def database(self) -> Path:
        return self.root / "batches.sqlite3"

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def file(self, file_id: str) -> Path:
        return self.files / file_id

    def results(self, batch_id: str) -> Path:
        return self.results_dir / f"{batch_id}.jsonl"

    def upload(self) -> Path:
        """A fresh name for a file being received (removed at start if a kill left one)."""
        return self.files / f".upload-{uuid.uuid4().hex}"

    def make(self) -> None:
        for folder in (self.root, self.files, self.results_dir):
            folder.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class FileRecord:
    """A stored file. ``urls`` maps each route its lines name to its first line (inputs)."""

    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    created_at: int
    urls: dict[str, int] = field(default_factory=dict)

    def to_api(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass(frozen=True)
class BatchRecord:
    """A batch job; ``total`` is its input's line count, ``completed``/``failed`` as OpenAI
    counts them (successes, and every other result)."""

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    total: int
    completed: int = 0
    failed: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def to_api(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        out = asdict(self)
        del out["owner"]
        total, completed, failed = out.pop("total"), out.pop("completed"), out.pop("failed")
        errors = out.pop("errors")
        return {
            **out,
            "object": "batch",
            "errors": None if errors is None else {"object": "list", "data": errors},
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "expires_at": None,  # jobs never expire here
            "expired_at": None,
        }


_FILE_COLUMNS = tuple(f.name for f in fields(FileRecord))
_BATCH_COLUMNS = tuple(f.name for f in fields(BatchRecord))
_JSON_COLUMNS = ("urls", "metadata", "errors")


def _to_row(record: FileRecord | BatchRecord, columns: tuple[str, ...]) -> tuple[Any, ...]:
    values = []
    for name in columns:
        value = getattr(record, name)
        values.append(json.dumps(value) if name in _JSON_COLUMNS and value is not None else value)
    return tuple(values)


def _from_row(cls: Callable[..., T], row: sqlite3.Row, columns: tuple[str, ...]) -> T:
    values = {name: row[name] for name in columns}
    for name in _JSON_COLUMNS:
        if name in values and values[name] is not None:
            values[name] = json.loads(values[name])
    return cls(**values)


class InUse(Exception):
    """A file an unfinished batch reads."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id


class Store:
    """The database of one data dir; every method runs on the store's own thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._db: sqlite3.Connection | None = None

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "open() first"
        return self._db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # --- opening -----------------------------------------------------------------------------

    async def open(self) -> None:
        await self._call(self._open)

    def _open(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # WAL with NORMAL: a killed process loses no commit (only a power cut may lose
            # the last ones), and commits need no fsync of their own.
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=5000")
            self._db = db
            self._migrate()
        except BaseException:
            db.close()
            self._db = None
            raise

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ValueError(
                f"data_dir: {self.path} has schema version {version}, newer than this "
                f"server's {SCHEMA_VERSION}: run a newer server, or choose another --data-dir"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._transaction() as db:
                for statement in _MIGRATIONS[target - 1].split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={target}")

    async def close(self) -> None:
        if self._db is not None:
            await self._call(self._close)
        self._executor.shutdown(wait=False)  # idle: the close ran on it

    def _close(self) -> None:
        self.db.close()
        self._db = None

    # --- files -------------------------------------------------------------------------------

    async def add_file(self, record: FileRecord) -> None:
        await self._call(self._add_files, [record])

    def _add_files(self, records: list[FileRecord]) -> None:
        columns = ", ".join(_FILE_COLUMNS)
        marks = ", ".join("?" * len(_FILE_COLUMNS))
        updates = ", ".join(f"{c} = excluded.{c}" for c in _FILE_COLUMNS if c != "id")
        for record in records:  # a redone finalization writes the same ids again
            self.db.execute(
                f"INSERT INTO files ({columns}) VALUES ({marks}) "
                f"ON CONFLICT(id) DO UPDATE SET {updates}",
                _to_row(record, _FILE_COLUMNS),
            )

    async def file(self, file_id: str, owner: str | None) -> FileRecord | None:
        """The file ``file_id`` when ``owner`` owns it (None: whoever does)."""
        return await self._call(self._file, file_id, owner)

    def _file(self, file_id: str, owner: str | None) -> FileRecord | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return _from_row(FileRecord, row, _FILE_COLUMNS)

    async def files(
        self, owner: str, limit: int, after: str | None, purpose: str | None, ascending: bool
    ) -> tuple[list[FileRecord], bool]:
        """A page of ``owner``'s files by creation (after the file ``after``); more left?"""
        return await self._call(self._page, "files", owner, limit, after, purpose, ascending)

    async def file_ids(self) -> set[str]:
        return await self._call(lambda: {r[0] for r in self.db.execute("SELECT id FROM files")})

    async def delete_file(self, file_id: str, owner: str) -> FileRecord | None:
        """Forget ``owner``'s file (its bytes are the caller's to remove); `InUse` while an
        unfinished batch reads it."""
        return await self._call(self._delete_file, file_id, owner)

    def _delete_file(self, file_id: str, owner: str) -> FileRecord | None:
        with self._transaction() as db:
            record = self._file(file_id, owner)
            if record is None:
                return None
            marks = ", ".join("?" * len(ACTIVE))
            user = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks}) "
                "ORDER BY seq LIMIT 1",
                (file_id, *ACTIVE),
            ).fetchone()
            if user is not None:
                raise InUse(user[0])
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            return record

    # --- batches -----------------------------------------------------------------------------

    async def add_batch(self, record: BatchRecord) -> None:
        await self._call(self._add_batch, record)

    def _add_batch(self, record: BatchRecord) -> None:
        columns = ", ".join(_BATCH_COLUMNS)
        marks = ", ".join("?" * len(_BATCH_COLUMNS))
        self.db.execute(
            f"INSERT INTO batches ({columns}) VALUES ({marks})", _to_row(record, _BATCH_COLUMNS)
        )

    async def batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        """The batch ``batch_id`` when ``owner`` owns it (None: whoever does)."""
        return await self._call(self._batch, batch_id, owner)

    def _batch(self, batch_id: str, owner: str | None) -> BatchRecord | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return _from_row(BatchRecord, row, _BATCH_COLUMNS)

    async def batches(
        self, owner: str, limit: int, after: str | None
    ) -> tuple[list[BatchRecord], bool]:
        """A page of ``owner``'s batches, newest first (after the batch ``after``)."""
        return await self._call(self._page, "batches", owner, limit, after, None, False)

    def _page(
        self,
        table: str,
        owner: str,
        limit: int,
        after: str | None,
        purpose: str | None,
        ascending: bool,
    ) -> tuple[list[Any], bool]:
        where, args = ["owner = ?"], [owner]
        if after is not None:
            # A cursor of another owner, or none at all, starts nowhere: an empty page.
            where.append(
                f"seq {'>' if ascending else '<'} "
                f"(SELECT seq FROM {table} WHERE id = ? AND owner = ?)"
            )
            args += [after, owner]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        rows = self.db.execute(
            f"SELECT * FROM {table} WHERE {' AND '.join(where)} "
            f"ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        cls, columns = (
            (FileRecord, _FILE_COLUMNS) if table == "files" else (BatchRecord, _BATCH_COLUMNS)
        )
        return [_from_row(cls, r, columns) for r in rows[:limit]], len(rows) > limit

    async def next_active(self) -> BatchRecord | None:
        """The oldest batch with work left."""
        return await self._call(self._next_active)

    def _next_active(self) -> BatchRecord | None:
        marks = ", ".join("?" * len(ACTIVE))
        row = self.db.execute(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq LIMIT 1", ACTIVE
        ).fetchone()
        return None if row is None else _from_row(BatchRecord, row, _BATCH_COLUMNS)

    async def active_ids(self) -> set[str]:
        marks = ", ".join("?" * len(ACTIVE))
        query = f"SELECT id FROM batches WHERE status IN ({marks})"
        return await self._call(lambda: {r[0] for r in self.db.execute(query, ACTIVE)})

    async def update(self, batch_id: str, **values: Any) -> BatchRecord:
        """Set some of a batch's columns; the batch as it is now."""
        return await self._call(self._update, batch_id, values)

    def _update(self, batch_id: str, values: dict[str, Any]) -> BatchRecord:
        current = self._batch(batch_id, None)
        assert current is not None, batch_id
        changed = replace(current, **values)
        names = list(values)
        self.db.execute(
            f"UPDATE batches SET {', '.join(f'{n} = ?' for n in names)} WHERE id = ?",
            (*_to_row(changed, tuple(names)), batch_id),
        )
        return changed

    async def request_cancel(self, batch_id: str, owner: str) -> BatchRecord | None:
        """Mark ``owner``'s batch cancelling if it has work left; the batch as it is now."""
        return await self._call(self._request_cancel, batch_id, owner)

    def _request_cancel(self, batch_id: str, owner: str) -> BatchRecord | None:
        with self._transaction():
            current = self._batch(batch_id, owner)
            if current is None or current.status != "in_progress":
                return current
            return self._update(batch_id, {"status": "cancelling", "cancelling_at": now()})

    async def finish(self, batch_id: str, outputs: list[FileRecord], **values: Any) -> None:
        """Register a batch's output files and set its final columns, in one transaction."""
        await self._call(self._finish, batch_id, outputs, values)

    def _finish(self, batch_id: str, outputs: list[FileRecord], values: dict[str, Any]) -> None:
        with self._transaction():
            self._add_files(outputs)
            self._update(batch_id, values)
