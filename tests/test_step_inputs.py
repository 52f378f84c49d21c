"""The values each launch hands the runtime (core/step_inputs.py): what a step's device work
reads of its sequences, and that it stays what it was when they move on."""

from __future__ import annotations

import numpy as np
import pytest

from decoding.text_grammar import TextGrammar
from vlm_server.engine.api import GenerationRequest, Task
from vlm_server.engine.core.prefix_cache import PrefixEntry
from vlm_server.engine.core.sequence import Sequence
from vlm_server.engine.core.step_inputs import LaunchInputs
from vlm_server.engine.core.step_plan import (
    DEVICE_INPUT,
    HELD,
    T_ID,
    T_POS,
    T_ROW,
    Chunk,
    StepPlan,
)

PREFIX = 10  # BOS + image positions; pages of 4, so the prefix's third page is partly filled


def _seq(row: int, prompt: int, prefix: PrefixEntry | None = None, adapter: int = -1) -> Sequence:
    request = GenerationRequest(Task.QUERY, None)
    seq = Sequence(request, list(range(1, prompt + 1)), TextGrammar(0, 8), PREFIX if prefix else 0)
    seq.row, seq.prefix, seq.adapter_slot = row, prefix, adapter
    seq.own_pages = [40 + row, 50 + row]
    return seq


def _admitted(inputs: LaunchInputs, *seqs: Sequence) -> None:
    for seq in seqs:
        inputs.admit(seq.row, seq.adapter_slot)


def test_a_decode_step_is_its_rows_and_positions() -> None:
    inputs = LaunchInputs(8)
    seqs = [_seq(3, 5, adapter=2), _seq(6, 2)]
    _admitted(inputs, *seqs)
    seqs[0].decode_launched = 4
    step = inputs.decode(seqs, [1, 6])
    assert step.n_decode == step.n_rows == 2
    assert step.rows.tolist() == [3, 6]
    assert step.tokens[:, T_POS].tolist() == [5 + 4, 2]
    assert (step.tokens[:, T_ID] == DEVICE_INPUT).all()
    assert step.last.tolist() == [0, 1]
    assert step.adapter_slots.tolist() == [2, -1] and step.uses_adapters()
    assert step.block_rows == (1, 6)


def test_a_mixed_step_carries_pages_tails_and_references() -> None:
    inputs = LaunchInputs(8)
    entry = PrefixEntry("image", [1, 2], 3)
    running = _seq(0, 3)
    first = _seq(4, 6, prefix=entry)  # its first chunk: the prefix's pages and its tail
    second = _seq(5, 6, prefix=entry)  # a later chunk: none of them
    refs = _seq(2, 4)
    refs.ref_values = np.array([[0.0, 0.25, 0.0, 0.0]])
    held = _seq(7, 3, prefix=entry)
    _admitted(inputs, running, first, second, refs, held)
    plan = StepPlan(1, [Chunk(0, 4, False), Chunk(2, 4, True), Chunk(0, 4, True), Chunk.held(3)])
    step = inputs.mixed([running, first, second, refs, held], plan, [])
    assert step.n_decode == 1 and step.rows.tolist() == [0, 4, 5, 2, 7]
    assert step.tails == ((3, 44),)  # the partly filled page into the first own page
    assert step.prefix_pages == (1, 2, 3)
    assert step.ref_rows == (2,)
    [(row, values)] = step.ref_writes
    assert row == 2 and values.tolist() == refs.ref_values.tolist()
    assert step.tokens[1:5, T_POS].tolist() == [PREFIX, PREFIX + 1, PREFIX + 2, PREFIX + 3]
    assert (step.tokens[1:5, T_ROW] == 4).all()
    assert step.last[-1] == HELD - 7
    assert step.block_rows == () and not step.uses_adapters()


def test_a_step_stays_what_it_was_when_its_sequences_move_on() -> None:
    inputs = LaunchInputs(4)
    seq = _seq(1, 3, adapter=0)
    _admitted(inputs, seq)
    step = inputs.decode([seq], [1])
    seq.decode_launched += 1
    seq.row, seq.adapter_slot = 2, -1  # as if its row went to another request
    inputs.admit(1, -1)
    assert step.rows.tolist() == [1] and step.tokens[0, T_POS] == 3
    assert step.adapter_slots.tolist() == [0]
    for array in (step.rows, step.adapter_slots, step.tokens, step.last):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 0


def test_a_prefix_job_holds_values_of_its_riding_prompt() -> None:
    inputs = LaunchInputs(4)
    entry = PrefixEntry("image", [1, 2], 3)
    seq = _seq(2, 3, prefix=entry, adapter=1)
    seq.rides_prefix = True
    job = inputs.prefix_job(entry, seq, prompt_pages=4)
    assert job.pages == (1, 2, 3) and job.adapter_slot == 1
    assert job.prompt is not None and job.prompt.row == 2
    assert job.prompt.pages == (1, 2, 42, 52)  # the first own page stands in for page 3
    assert not job.prompt.ids.flags.writeable
    seq.rides_prefix = False
    assert inputs.prefix_job(entry, seq, prompt_pages=4).prompt is None
