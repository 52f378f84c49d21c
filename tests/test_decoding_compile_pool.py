"""Client constraints compiled in a child process: the same masks as in process, the same
refusals, a hard bound on a child that stops answering, and cancellation that kills the child
and caches nothing."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from decoding.compile_pool import CompileCancelled, CompileJob, CompilePool
from decoding.constraints import ConstraintCompiler
from decoding.limits import CompileTimeout, ConstraintLimits
from decoding.mask_table import MaskTable
from decoding.token_masks import MAX_ROWS
from decoding.vocab import TokenVocab
from tests.support.service_harness import wait_for
from tests.support.toy_tokenizers import byte_level_bpe

EOS = 0
PAD = 16


@pytest.fixture(scope="module")
def vocab() -> TokenVocab:
    return TokenVocab.from_tokenizer(byte_level_bpe())


def _compiler(vocab: TokenVocab, in_child: bool, **limits: float) -> ConstraintCompiler:
    table = MaskTable(vocab.size + PAD, max_rows=1024)
    return ConstraintCompiler(
        vocab, table, EOS, limits=ConstraintLimits(**limits), in_child=in_child
    )


def _pool(vocab: TokenVocab, grace: float = 1.0) -> CompilePool:
    job = CompileJob(vocab, EOS, vocab.size + PAD, frozenset(), 4096, MAX_ROWS)
    return CompilePool(job, grace=grace)


def test_a_child_compiles_the_masks_the_process_would(vocab: TokenVocab) -> None:
    here, there = _compiler(vocab, False), _compiler(vocab, True)
    try:
        for make in (
            lambda c: c.choices(["red car", "blue bus", "no"]),
            lambda c: c.regex(r"[0-9]{1,3} (cars|dogs)"),
        ):
            a, b = make(here).compiled, make(there).compiled
            assert np.array_equal(a.dfa.trans, b.dfa.trans)
            for name in ("rows", "dist", "level_base", "level_ptr", "level_rows"):
                assert np.array_equal(getattr(a, name), getattr(b, name)), name
    finally:
        there.close()


def test_a_child_refuses_what_the_process_refuses(vocab: TokenVocab) -> None:
    compiler = _compiler(vocab, True, max_constraint_states=64)
    try:
        with pytest.raises(ValueError, match="states"):
            compiler.regex(r"(a|b)*a(a|b){12}")
        with pytest.raises(CompileTimeout, match="budget"):
            _compiler(vocab, True, constraint_compile_seconds=1e-9).regex(r"[a-z]{3}[0-9]{2}")
    finally:
        compiler.close()


def test_a_child_that_stops_answering_is_killed_past_its_bound(vocab: TokenVocab) -> None:
    pool = _pool(vocab, grace=0.2)
    try:
        pool.warm()
        (pid,) = pool.pids
        os.kill(pid, signal.SIGSTOP)  # it will never answer
        with pytest.raises(CompileTimeout, match="budget"):
            pool.compile(("regex", "[a-z]+"), 0.1)
        assert not pool.pids  # killed, not left behind
        pool.compile(("regex", "[a-z]+"), 5.0)  # a new child takes over
        assert pool.started == 2
    finally:
        pool.close()


def test_cancelling_a_compilation_kills_its_child_and_caches_nothing(vocab: TokenVocab) -> None:
    compiler = _compiler(vocab, True)
    assert compiler.pool is not None
    compiler.warm()
    (pid,) = compiler.pool.pids
    os.kill(pid, signal.SIGSTOP)  # busy for good: only a cancel ends the wait
    outcome: list[BaseException] = []

    def compile_it() -> None:
        try:
            compiler.choices(["alpha", "beta"])
        except BaseException as err:
            outcome.append(err)

    worker = threading.Thread(target=compile_it)
    worker.start()
    wait_for(lambda: compiler.pool is not None and compiler.pool.compiling, what="a compile")
    compiler.cancel(["other"], None)  # another constraint's cancel: not this one's
    assert compiler.pool.compiling == ("choices", ("alpha", "beta"))
    compiler.cancel(["alpha", "beta"], None)
    worker.join(60)
    assert outcome and isinstance(outcome[0], CompileCancelled)
    rows = compiler.choices(["alpha", "beta"])  # not a cached refusal: compiled afresh
    compiler.release(rows)
    assert compiler.pool.started == 2
    compiler.close()
