"""The job manager: runs the Batch API's batches on the server's engine, one at a time.

Batches run oldest first with `run_batch`, the lines of each through the HTTP door's routes
(`LineRunner`), at most ``concurrency`` in flight. The batch's results file is the truth of
which lines are done: a restart (after a kill too) resumes every unfinished batch where its
file ends; the counts in the database follow it every `COUNTS_EVERY_S` and at the end. A
batch whose lines are all done is finalized: its results split into an output file (the
successes) and an error file (the rest), both registered as files of its owner, and the
batch completed. A cancelled batch starts no more lines; those in flight finish, and what is
done is finalized the same way (status cancelled). A drain (`stop_starting`) starts no more
lines: those in flight finish within the server's grace period or are cut off (`close`), and
the batch stays in progress, to resume at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from vlm_server.bulk import lines
from vlm_server.bulk.executor import LineRunner
from vlm_server.bulk.lines import LineError, parse_line
from vlm_server.bulk.results import ResultLog
from vlm_server.bulk.runner import Item, Progress, run_batch
from vlm_server.bulk.store import OUTPUT_PURPOSE, BatchRecord, DataDir, FileRecord, Store, now

log = logging.getLogger(__name__)

COUNTS_EVERY_S = 1.0  # how often a running batch's counts are written to the database
RETRY_AFTER_S = 2.0  # a batch the engine could not serve (503: it failed) tries again
_READ_BYTES = 1 << 20  # input lines parsed on the worker thread at once


class JobManager:
    """Runs the active batches of ``store`` (see the module)."""

    def __init__(self, store: Store, data: DataDir, runner: LineRunner, concurrency: int) -> None:
        self.store = store
        self.data = data
        self.runner = runner
        self.concurrency = concurrency
        self._wake = asyncio.Event()
        self._halt = asyncio.Event()  # a drain: start nothing more
        self._task: asyncio.Task[None] | None = None
        self._current: str | None = None  # the batch running now
        self._stop_current = asyncio.Event()
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # lock, users
        self._side: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-jobs")

    def wake(self) -> None:
        """A batch was created."""
        self._wake.set()

    def cancel(self, batch: BatchRecord) -> None:
        """``batch`` is cancelling in the database now: stop it, or finalize it if idle."""
        if self._current == batch.id:
            self._stop_current.set()
            return
        if self._halt.is_set():
            return  # stopping: it stays cancelling, finalized at the next start
        task = asyncio.create_task(self._settle(batch.id))
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def stop_starting(self) -> None:
        """Drain: no batch and no line starts from now on; lines in flight finish."""
        self._halt.set()
        self._stop_current.set()

    async def close(self, grace: float) -> None:
        """End the manager within ``grace`` seconds: lines still in flight then are cancelled,
        unwritten (they run at the next start); the results file is synced."""
        self.stop_starting()
        tasks = [t for t in (self._task, *self._side) if t is not None and not t.done()]
        if tasks and grace > 0:
            await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def _owning(self, batch_id: str) -> AsyncIterator[None]:
        """Hold ``batch_id`` (a cancel's finalization and the manager's run take turns)."""
        entry = self._locks.setdefault(batch_id, (asyncio.Lock(), [0]))
        entry[1][0] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1][0] -= 1
            if not entry[1][0]:  # nobody else holds or waits: forget it
                del self._locks[batch_id]

    async def _loop(self) -> None:
        while not self._halt.is_set():
            self._wake.clear()
            batch = await self.store.next_active()
            if batch is None:
                await _first(self._wake, self._halt)
                continue
            try:
                retry = await self._process(batch.id)
            except Exception as err:  # a bug or the disk: this batch fails, the next runs
                log.exception("batch %s failed", batch.id)
                try:
                    await self._fail(batch.id, "internal_error", f"the server failed it: {err}")
                    continue
                except Exception:  # the database itself: try again after a pause
                    log.exception("cannot mark batch %s failed", batch.id)
                    retry = True
            if retry:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._halt.wait(), RETRY_AFTER_S)
        log.info("batch jobs stopped")

    async def _settle(self, batch_id: str) -> None:
        """Finalize a batch cancelled while another one ran."""
        try:
            async with self._owning(batch_id):
                batch = await self.store.batch(batch_id)
                if batch is not None and batch.status == "cancelling":
                    await self._finalize(batch, "cancelled")
        except Exception:
            log.exception("finalizing the cancelled batch %s failed", batch_id)

    async def _process(self, batch_id: str) -> bool:
        """Run or finalize one batch; whether it should run again after a pause."""
        async with self._owning(batch_id):
            # Current before its status is read: a cancel that the read misses sees it.
            self._current, self._stop_current = batch_id, asyncio.Event()
            if self._halt.is_set():
                self._stop_current.set()
            try:
                batch = await self.store.batch(batch_id)
                assert batch is not None
                if batch.status == "in_progress":
                    done = await self._run(batch)
                    if done is None or self._halt.is_set():
                        return False
                    batch = await self.store.batch(batch_id)
                    assert batch is not None
                    if batch.status == "in_progress" and not done:
                        return True  # the engine refused: it failed, or the model reloads
                    if batch.status == "in_progress":
                        batch = await self.store.update(
                            batch_id, status="finalizing", finalizing_at=now()
                        )
                if batch.status == "finalizing":
                    await self._finalize(batch, "completed")
                elif batch.status == "cancelling":
                    await self._finalize(batch, "cancelled")
                return False
            finally:
                self._current = None

    async def _run(self, batch: BatchRecord) -> bool | None:
        """Run the lines not done yet; whether every line is done (None: the batch failed)."""
        source = self.data.file(batch.input_file_id)
        if not await asyncio.to_thread(source.is_file):
            await self._fail(batch.id, "input_file_missing", "its input file is gone")
            return None
        results = ResultLog(self.data.results(batch.id))
        await asyncio.to_thread(results.open)
        try:
            completed, failed = await asyncio.to_thread(tally, results.path)
            counts = _Counts(batch.id, completed, failed)

            def on_progress(p: Progress) -> None:
                counts.now = (completed + p.completed, failed + p.failed)

            writer = asyncio.create_task(self._write_counts(counts))
            try:
                progress = await run_batch(
                    read_items(source),
                    self.runner,
                    results,
                    self.concurrency,
                    Progress(total=batch.total),
                    on_progress,
                    self._stop_current,
                    finish_in_flight=True,
                )
            finally:
                writer.cancel()
            await self.store.update(batch.id, completed=counts.now[0], failed=counts.now[1])
        finally:
            await asyncio.to_thread(results.close)
        return not progress.interrupted

    async def _write_counts(self, counts: _Counts) -> None:
        while True:
            await asyncio.sleep(COUNTS_EVERY_S)
            if counts.now != counts.written:
                now_ = counts.now
                await self.store.update(counts.batch_id, completed=now_[0], failed=now_[1])
                counts.written = now_

    async def _finalize(self, batch: BatchRecord, status: str) -> None:
        """Split the results into the output and error files, register them, end the batch."""
        out_id, err_id = output_ids(batch.id)
        out_path, err_path = self.data.file(out_id), self.data.file(err_id)
        results = self.data.results(batch.id)
        n_out, n_err = await asyncio.to_thread(split_results, results, out_path, err_path)
        created, files = now(), []
        for file_id, path, count, kind in (
            (out_id, out_path, n_out, "output"),
            (err_id, err_path, n_err, "error"),
        ):
            if count:
                size = (await asyncio.to_thread(path.stat)).st_size
                name = f"{batch.id}_{kind}.jsonl"
                files.append(
                    FileRecord(file_id, batch.owner, OUTPUT_PURPOSE, name, size, count, created)
                )
            else:
                await asyncio.to_thread(path.unlink, True)
        await self.store.finish(
            batch.id,
            files,
            status=status,
            **{f"{status}_at": created},
            output_file_id=out_id if n_out else None,
            error_file_id=err_id if n_err else None,
            completed=n_out,
            failed=n_err,
        )
        await asyncio.to_thread(results.unlink, True)
        log.info(
            "batch ended",
            extra={"fields": {"batch": batch.id, "status": status, "ok": n_out, "errors": n_err}},
        )

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": None, "line": None}
        await self.store.update(batch_id, status="failed", failed_at=now(), errors=[error])


class _Counts:
    def __init__(self, batch_id: str, completed: int, failed: int) -> None:
        self.batch_id = batch_id
        self.now = self.written = (completed, failed)


def output_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files: the same when finalizing is redone."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-output", f"file-{suffix}-errors"


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class _InputReader:
    """The items of an input file, a megabyte of lines at a time (on a worker thread)."""

    def __init__(self, path: Path) -> None:
        self._file: BinaryIO = path.open("rb")
        self._number = 0

    def next(self) -> list[Item]:
        out: list[Item] = []
        size = 0
        while size < _READ_BYTES and (raw := self._file.readline()):
            size += len(raw)
            self._number += 1
            if not raw.strip():
                continue
            text = raw.decode(errors="replace")
            try:
                out.append(parse_line(text))
            except LineError as err:  # checked at upload: only a file changed since
                out.append((lines.custom_id_of(text) or f"line-{self._number}", err))
        return out

    def close(self) -> None:
        self._file.close()


async def read_items(path: Path) -> AsyncIterator[Item]:
    """The lines of the input file ``path``, parsed."""
    reader = await asyncio.to_thread(_InputReader, path)
    try:
        while items := await asyncio.to_thread(reader.next):
            for item in items:
                yield item
    finally:
        reader.close()


def _whole_results(path: Path) -> Iterator[tuple[bytes, Any]]:
    """(raw line, parsed) of every whole line of a results file (a torn tail skipped)."""
    with path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                yield raw, json.loads(raw)
            except ValueError:
                break


def tally(path: Path) -> tuple[int, int]:
    """(successes, the rest) among the results written so far."""
    ok = bad = 0
    if path.exists():
        for _, line in _whole_results(path):
            if lines.succeeded(line):
                ok += 1
            else:
                bad += 1
    return ok, bad


def split_results(results: Path, output: Path, errors: Path) -> tuple[int, int]:
    """Write the successes of ``results`` to ``output`` and the rest to ``errors`` (each
    complete and synced before it takes its name); their line counts."""
    counts = [0, 0]
    temps = [output.with_name(output.name + ".part"), errors.with_name(errors.name + ".part")]
    with temps[0].open("wb") as out, temps[1].open("wb") as err:
        if results.exists():
            for raw, line in _whole_results(results):
                good = lines.succeeded(line)
                (out if good else err).write(raw)
                counts[0 if good else 1] += 1
        for f in (out, err):
            f.flush()
            os.fsync(f.fileno())
    for temp, final in zip(temps, (output, errors), strict=True):
        os.replace(temp, final)
    return counts[0], counts[1]
