"""The Batch API of one server: its data dir, its store, its job manager.

The server assembly builds it when ``--data-dir`` is set, opens it at start (the database,
and a sweep of what a killed process left half-made), starts its jobs once the engine serves,
stops their lines from starting when it drains, and closes it last.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sqlite3
from pathlib import Path

from vlm_server.bulk.executor import LineRunner
from vlm_server.bulk.jobs import JobManager, output_ids
from vlm_server.bulk.store import DataDir, Store
from vlm_server.engine.api import BATCH_PRIORITY
from vlm_server.frontend.calls import ServiceCore

log = logging.getLogger(__name__)

# Every batch line runs at the lowest priority, whatever its body asks: batch work yields to
# interactive requests (the scheduler's headroom, engine/core/headroom.py).
LINE_PRIORITY = BATCH_PRIORITY


class BatchApi:
    """Files and batches under ``data_dir``: input files of at most ``max_file_bytes`` and
    ``max_lines`` lines; lines run ``concurrency`` at a time."""

    def __init__(
        self, data_dir: str | Path, max_file_bytes: int, max_lines: int, concurrency: int
    ) -> None:
        self.data = DataDir(Path(data_dir))
        self.max_file_bytes = max_file_bytes
        self.max_lines = max_lines
        self.concurrency = concurrency
        self.store = Store(self.data.database)
        self.jobs: JobManager | None = None
        self._lock: int | None = None

    async def open(self) -> None:
        """Take the data dir (one server at a time), open the database (migrating it) and
        remove what a killed process left: partial uploads, files written but never
        registered, results of ended batches."""
        await asyncio.to_thread(self.data.make)
        self._lock = await asyncio.to_thread(_take, self.data.root / ".lock")
        try:
            await self._open()
        except BaseException:
            await self.close()
            raise

    async def _open(self) -> None:
        try:
            await self.store.open()
        except sqlite3.Error as err:
            raise ValueError(f"data_dir: cannot open {self.data.database}: {err}") from None
        known = await self.store.file_ids()
        active = await self.store.active_ids()
        pending = {i for b in active for i in output_ids(b)}  # finalized again at resume
        removed = await asyncio.to_thread(self._sweep, known | pending, active)
        if removed:
            log.info("removed %d leftover files from %s", removed, self.data.root)

    def _sweep(self, files: set[str], active: set[str]) -> int:
        removed = 0
        for path in self.data.files.iterdir():
            if path.name not in files:
                path.unlink(missing_ok=True)
                removed += 1
        for path in self.data.results_dir.iterdir():
            if path.stem not in active:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def start(self, core: ServiceCore) -> None:
        """Run batches on ``core``'s engine (call once it serves)."""
        runner = LineRunner(core, LINE_PRIORITY)
        self.jobs = JobManager(self.store, self.data, runner, self.concurrency)
        self.jobs.start()

    def stop_starting(self) -> None:
        """The server drains: no batch line starts from now on."""
        if self.jobs is not None:
            self.jobs.stop_starting()

    async def stop_jobs(self, grace: float) -> None:
        """Stop the jobs (lines still running after ``grace`` s are cut off, unwritten)."""
        if self.jobs is not None:
            await self.jobs.close(grace)

    async def close(self) -> None:
        """Close the database (after the HTTP door: its routes read it to the end)."""
        await self.stop_jobs(0)
        await self.store.close()
        if self._lock is not None:
            os.close(self._lock)  # the data dir is free for the next server
            self._lock = None


def _take(path: Path) -> int:
    """An exclusive lock on ``path``, held while the descriptor is open (a killed process's
    goes with it): two servers on one data dir would run the same batches twice."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"data_dir: {path.parent} is in use by another server") from None
    return fd
