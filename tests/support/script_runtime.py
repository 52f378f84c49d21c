"""A runtime without a model for scheduler tests (engine/core/runtime_protocol.py): steps
sample a fixed token, and a batch of image prefixes is done when the test says so, or when a
step that waits for it on the device (``after``) is read: by then the device ran the batch,
and every earlier one of its lane (a lane runs in order).

What the scheduler hands it is recorded: each prefix batch's jobs, in launch order, each
mixed step's rows with the batch it waits for, and each decode step's rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vlm_server.engine.core.prefix_jobs import PrefixJob
from vlm_server.engine.core.step_inputs import StepInputs
from vlm_server.engine.core.step_layout import N_OUT, O_TOKEN


@dataclass(eq=False)
class Batch:
    """One batch of new image prefixes on the (pretend) prefill stream."""

    jobs: list[PrefixJob]
    done: bool = False
    interactive: bool = False  # on the interactive lane


@dataclass
class ScriptRuntime:
    kv_pages: int
    rows: int
    row_pages: int  # block-table width: the most pages one sequence holds
    prefix_slots: int = 2
    prefix_prompt_tokens: int = 0
    interactive_prefix_slots: int = 0
    interactive_prefill_batch: int = 0
    token: int = 1  # what every sampling row draws (not the scheduler's eos: answers run on)
    batches: list[Batch] = field(default_factory=list)
    # Each mixed step: its rows (decode rows first) and the batch it waits for (or None).
    mixed: list[tuple[list[int], Batch | None]] = field(default_factory=list)
    decodes: list[list[int]] = field(default_factory=list)  # each decode step's rows
    block_table: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.block_table = np.zeros((self.rows, self.row_pages), np.int32)
        self._after: dict[int, Batch] = {}  # slot -> the batch its step waits for

    def finish_batches(self) -> None:
        """Every prefix batch launched so far completes."""
        for batch in self.batches:
            batch.done = True

    def launch_prefixes(
        self, jobs: list[PrefixJob], partitioned: bool = False, interactive: bool = False
    ) -> Batch:
        assert not interactive or self.interactive_prefix_slots, "the lane is off"
        batch = Batch(list(jobs), interactive=interactive)
        self.batches.append(batch)
        return batch

    def prefix_ready(self, handle: object) -> bool:
        assert isinstance(handle, Batch)
        return handle.done

    def launch_mixed(self, slot: int, step: StepInputs, after: object | None = None) -> None:
        assert after is None or isinstance(after, Batch)
        self.mixed.append((step.rows.tolist(), after))
        if after is not None:
            self._after[slot] = after

    def launch_decode(self, slot: int, step: StepInputs) -> None:
        self.decodes.append(step.rows.tolist())

    def finalize(
        self, slot: int, fin: np.ndarray, constrained: bool, regions: bool, greedy: bool = False
    ) -> None:
        pass

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        after = self._after.pop(slot, None)
        if after is not None:  # the step waited for it, and its lane ran in order
            for batch in self.batches[: self.batches.index(after) + 1]:
                batch.done = batch.done or batch.interactive == after.interactive
        out = np.zeros((b, N_OUT), np.float32)
        out[:, O_TOKEN] = self.token
        return out
