"""Finetune adapters for the engine: find or download an adapter's file, check it, keep it
resident in one of the device's adapter slots, and pin that slot for each request using it.

`AdapterManager.acquire` blocks (disk, network, the wait for a free slot, the copy up), so it
runs on threads of its own: never the event loop, never the scheduler thread. The file is
read, checked and packed into the bank's slot layout by a child process (adapter_reader.py),
so that a load holds this process's GIL for next to nothing; this thread then copies the
packed slot into the pinned staging buffer (one tensor copy, the GIL released) and up into
the slot on a side stream, beside the steps. A slot is written only
while no row uses it (core/adapter_slots.py), and handed to a request only after its copy
completed. An adapter's image prefixes are cached apart from the base model's and other
adapters' (`qualify_image`): LoRA changes the prefix's keys and values too.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import torch

from vlm_server.engine.adapter_reader import AdapterReader, shared_reader
from vlm_server.engine.api import EngineError, ErrorCode, GenerationRequest
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.adapter_slots import AdapterSlots
from vlm_server.models.lora.bank import LoraBank
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.store import AdapterStore

FIELD = "adapter"  # the doors name it as their request spells it (settings.adapter, model)
_KEY_MARK = "|adapter="


def qualify_image(req: GenerationRequest) -> GenerationRequest:
    """``req`` with its image's cache key made (image, adapter): prefixes computed with an
    adapter are never shared with another adapter or the base model."""
    image = req.image
    if not req.adapter or image is None or _KEY_MARK in image.content_hash:
        return req
    key = f"{image.content_hash}{_KEY_MARK}{req.adapter}"
    return dataclasses.replace(req, image=dataclasses.replace(image, content_hash=key))


class _ShortGilSwitch:
    """While any adapter loads, a Python thread yields the GIL after 0.5 ms instead of the
    interpreter's interval (5 ms by default): what Python a load still runs here (a download's
    loop, the reader's replies) never keeps the scheduler thread waiting a whole interval for
    a tick (measured when the file was read here too: the step gaps' p99 three times their
    median while an adapter loaded). Reference counted across loads."""

    INTERVAL_S = 0.0005

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.INTERVAL_S))
            self._users += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_SHORT_GIL_SWITCH = _ShortGilSwitch()


class AdapterManager:
    """Resident adapters in ``bank``'s slots, least recently used reused first."""

    def __init__(
        self, cfg: EngineConfig, bank: LoraBank, reader: AdapterReader | None = None
    ) -> None:
        self.bank = bank
        self.max_rank = cfg.max_adapter_rank
        self.wait_s = cfg.adapter_wait_s
        self.store = AdapterStore(
            Path(cfg.adapters_dir) if cfg.adapters_dir else None,
            cfg.adapter_endpoint,
            cfg.adapter_api_key,
            cfg.adapter_download_bytes,
            cfg.adapter_download_timeout_s,
            scheme=bank.targets.format,  # the family's downloads
        )
        self.reader = reader if reader is not None else shared_reader()
        # Where the slot layout holds all of an adapter (no expert layers), a child reads it.
        # The first load should not wait for a child's imports.
        warm = threading.Thread(target=self.reader.warm, name="adapter-reader-warm")
        warm.daemon = True
        warm.start()
        self.slots = AdapterSlots(bank.n_slots)
        self.ranks: dict[str, int] = {}
        self._cv = threading.Condition()
        self._loading: dict[str, threading.Event] = {}
        is_cuda = bank.device.type == "cuda"
        self._stream = torch.cuda.Stream(bank.device) if is_cuda else None

    def loaded(self) -> list[tuple[str, int]]:
        """(name, rank) of every resident adapter, most recently used first."""
        with self._cv:
            return [(n, self.ranks.get(n, 0)) for n, _ in reversed(self.slots.resident())]

    def acquire(self, name: str, until: float | None = None) -> int:
        """Pin a slot holding adapter ``name``, loading it first if needed; returns the slot.
        Blocks, for a slot at most ``adapter_wait_s`` and never past ``until`` (the request's
        deadline, ``time.monotonic()``); raises EngineError naming the adapter field."""
        bound = time.monotonic() + self.wait_s
        deadline = bound if until is None else min(bound, until)
        while True:
            with self._cv:
                slot = self.slots.pin(name)
                if slot is not None:
                    return slot
                other = self._loading.get(name)
                if other is None:
                    done = self._loading[name] = threading.Event()
                    break
            # Another request loads it (a download may take its whole time bound): wait for
            # that, then pin it, or load it again if that load failed.
            limit = bound + self.store.timeout_s
            limit = limit if until is None else min(limit, until)
            if not other.wait(max(0.0, limit - time.monotonic())):
                raise self._timeout(name, until)
        try:
            with _SHORT_GIL_SWITCH:
                return self._load(name, deadline, until)
        finally:
            with self._cv:
                self._loading.pop(name, None)
                done.set()
                self._cv.notify_all()

    def release(self, slot: int) -> None:
        """A request no step in flight still reads is done with ``slot``. Thread-safe."""
        with self._cv:
            self.slots.unpin(slot)
            self._cv.notify_all()

    def _load(self, name: str, deadline: float, until: float | None) -> int:
        bank = self.bank
        try:
            path = self.store.path(name)
            # Parsed and checked in a child process (adapter_reader.py): no GIL here.
            read = self.reader.read(path, name, bank.transfer, bank.dtype, until)
            rank, packed, release = read.rank, read.packed, read.release
        except AdapterError as err:
            code = ErrorCode.UNAVAILABLE if err.retryable else ErrorCode.INVALID_ARGUMENT
            raise EngineError(code, f"{FIELD}: {err}", FIELD) from None
        except TimeoutError:
            raise self._timeout(name, until) from None
        try:
            with self._cv:
                slot = self.slots.claim()
            if slot is None:
                # Waiting for a slot may take a while: free the reader for other loads.
                packed = packed.clone()  # one copy, the GIL released
                release()
                slot = self._claim(name, deadline, until)
            try:
                # The bank's one staging buffer: free again once the copy from it completed.
                with bank.stage_lock:
                    self._write(slot, bank.staging_from(packed), rank)
            except BaseException:
                with self._cv:
                    self.slots.abandon(slot)
                    self._cv.notify_all()
                raise
        finally:
            release()
        with self._cv:
            self.slots.filled(slot, name)
            self.ranks[name] = rank
        return slot

    def _claim(self, name: str, deadline: float, until: float | None) -> int:
        """A free slot, waiting for one until ``deadline``."""
        with self._cv:
            while (slot := self.slots.claim()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timeout(name, until)
                self._cv.wait(left)
        return slot

    def _write(self, slot: int, staged: object, rank: int) -> None:
        if self._stream is None:
            self.bank.write(slot, staged, rank)
            return
        # A side stream: the steps on the compute stream do not wait for this copy; this
        # thread does, before any request may use the slot.
        with torch.cuda.stream(self._stream):
            self.bank.write(slot, staged, rank)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # the loader thread's wait, never the scheduler tick's

    def _timeout(self, name: str, until: float | None) -> EngineError:
        """The request's deadline passed (DEADLINE_EXCEEDED), else the wait bound."""
        if until is not None and time.monotonic() >= until:
            return EngineError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"{FIELD}: the deadline passed while adapter {name!r} was being loaded",
                FIELD,
            )
        return self._exhausted(name)

    def _exhausted(self, name: str) -> EngineError:
        return EngineError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"{FIELD}: no adapter slot came free for {name!r} within {self.wait_s:g} s: all "
            f"{self.bank.n_slots} (max_adapters) are used by running requests",
            FIELD,
        )
