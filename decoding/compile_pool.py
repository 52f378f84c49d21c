"""Compiling client constraints in a child process, so that no compilation holds the server's
GIL.

Determinizing a regex or a trie of choices and walking the vocabulary through it is Python and
numpy work of up to the whole compile budget (2 s by default); on a thread of the server it
took the GIL from the event loop for hundreds of milliseconds at a time. `CompilePool` runs
each compilation in a process of its own (spawned on first use, kept for the next), under the
same cooperative budget as before, and adds what a thread cannot give:

* a hard bound: a child still busy ``grace`` seconds past its budget is killed, and the
  compilation fails with `CompileTimeout`;
* cancellation: `cancel` kills the child compiling a given constraint (its requester has
  gone), and that compilation fails with `CompileCancelled`.

A killed child is replaced on the next compilation. The parent waits on a pipe (no GIL held)
and only unpickles the result: a few numpy arrays.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .automaton import Dfa, choices_dfa
from .limits import CompileBudget, CompileTimeout, ConstraintTooLarge
from .regex_dfa import parse_regex, regex_dfa
from .token_masks import CompiledMasks, MaskCache, compile_masks
from .vocab import TokenVocab

Key = tuple[str, str | tuple[str, ...]]  # ("choices", (...)) or ("regex", pattern)
_POLL_S = 0.05
_START_S = 120.0  # a child's start-up (its imports): generous, a loaded machine is slow
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_REFUSALS: dict[str, type[Exception]] = {
    "CompileTimeout": CompileTimeout,
    "ConstraintTooLarge": ConstraintTooLarge,
    "ValueError": ValueError,
}


class CompileCancelled(RuntimeError):
    """The compilation was cancelled (its requester went away); nothing was cached."""


@dataclass(frozen=True)
class CompileJob:
    """What a child needs to compile constraints for one vocabulary."""

    vocab: TokenVocab
    eos_id: int
    width: int
    blocked: frozenset[int]
    max_dfa_states: int
    max_rows: int


def build_dfa(key: Key, max_dfa_states: int, budget: CompileBudget) -> Dfa:
    """The automaton of a constraint key (the same in a child and in process)."""
    kind, spec = key
    if kind == "choices":
        assert isinstance(spec, tuple)
        return choices_dfa(list(spec), budget)
    assert isinstance(spec, str)
    return regex_dfa(parse_regex(spec), max_dfa_states, budget)


def serve(fd: int) -> None:
    """The child's entry point: compile each key it is sent until the pipe closes. The first
    message is its `CompileJob`; it answers ``"ready"`` once set up."""
    conn = Connection(fd)
    job: CompileJob = conn.recv()
    cache = MaskCache(use_disk=False)
    conn.send("ready")
    while True:
        try:
            key, seconds = conn.recv()
        except (EOFError, OSError):
            return
        budget = CompileBudget(seconds)
        try:
            dfa = build_dfa(key, job.max_dfa_states, budget)
            reply: Any = compile_masks(
                dfa, job.vocab, job.eos_id, job.width, job.blocked, cache, job.max_rows, budget
            )
        except (CompileTimeout, ValueError) as err:
            name = type(err).__name__
            reply = (name if name in _REFUSALS else "ValueError", str(err))
        conn.send(reply)


class CompilePool:
    """One child process compiling constraints for ``job``'s vocabulary, one at a time.

    `compile` blocks its (non-loop) caller thread until the child answers, the hard bound
    passes or `cancel` is called; callers are serialized."""

    def __init__(self, job: CompileJob, grace: float = 1.0) -> None:
        self.job = job
        self.grace = grace
        self._lock = threading.Lock()  # one compilation at a time
        self._state = threading.Lock()  # guards the fields below
        self._process: Any = None
        self._conn: Connection | None = None
        self._current: Key | None = None
        self._cancelled = False
        self.started = 0  # children spawned (a killed one is replaced)

    def compile(self, key: Key, seconds: float) -> CompiledMasks:
        """The masks of ``key`` within ``seconds`` of compile budget; raises what compiling
        raises in process (CompileTimeout, ConstraintTooLarge, ValueError), or
        CompileCancelled."""
        with self._lock:
            conn = self._ensure()
            with self._state:
                self._current, self._cancelled = key, False
            try:
                conn.send((key, seconds))
                reply = self._wait(conn, time.monotonic() + seconds + self.grace, seconds)
            finally:
                with self._state:
                    self._current = None
        if isinstance(reply, tuple):
            name, message = reply
            raise _REFUSALS[name](message)
        return reply

    def _wait(self, conn: Connection, hard: float, seconds: float) -> Any:
        while True:
            if self._cancelled:
                self._kill()
                raise CompileCancelled("the request went away while its constraint compiled")
            if time.monotonic() > hard:
                self._kill()
                raise CompileTimeout(
                    f"compiling the constraint took longer than its {seconds:g} s budget "
                    "(constraint_compile_seconds); simplify it or retry later"
                )
            try:
                if conn.poll(_POLL_S):
                    return conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise CompileTimeout("the constraint compiler stopped; retry") from None

    @property
    def compiling(self) -> Key | None:
        """The constraint the child is compiling now, if any."""
        return self._current

    def warm(self) -> None:
        """Start the child now, so that the first compilation does not wait for it."""
        with self._lock:
            self._ensure()

    def cancel(self, key: Key) -> bool:
        """Stop compiling ``key`` if that is what the child is doing; True if it was."""
        with self._state:
            if self._current != key:
                return False
            self._cancelled = True
        return True

    def _ensure(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        self._kill()
        # A plain child that imports this package only (a spawned multiprocessing child would
        # import the server's main module, torch and all); never a fork of the server, whose
        # threads (gRPC, the scheduler) a fork would copy in whatever state they were.
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        code = f"from decoding.compile_pool import serve; serve({theirs.fileno()})"
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env
            )
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        self._process, self._conn = process, conn
        self.started += 1
        try:
            conn.send(self.job)
            ready = conn.poll(_START_S) and conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill()
            raise CompileTimeout("the constraint compiler did not start; retry")
        return conn

    def _kill(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.wait(5)

    def close(self) -> None:
        with self._state:
            self._cancelled = True
        with self._lock:
            self._kill()

    @property
    def pids(self) -> Sequence[int]:
        """The running child's process id (none before the first compilation)."""
        process = self._process
        return [process.pid] if process is not None and process.poll() is None else []
