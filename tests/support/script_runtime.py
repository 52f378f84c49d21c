"""A runtime without a model for scheduler tests (engine/core/runtime_protocol.py): steps
sample a fixed token, and a batch of image prefixes is done when the test says so.

What the scheduler hands it is recorded: each prefix batch's jobs, in launch order."""

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


@dataclass
class ScriptRuntime:
    kv_pages: int
    rows: int
    row_pages: int  # block-table width: the most pages one sequence holds
    prefix_slots: int = 2
    prefix_prompt_tokens: int = 0
    token: int = 1  # what every sampling row draws (not the scheduler's eos: answers run on)
    batches: list[Batch] = field(default_factory=list)
    block_table: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.block_table = np.zeros((self.rows, self.row_pages), np.int32)

    def finish_batches(self) -> None:
        """Every prefix batch launched so far completes."""
        for batch in self.batches:
            batch.done = True

    def launch_prefixes(self, jobs: list[PrefixJob], partitioned: bool = False) -> Batch:
        batch = Batch(list(jobs))
        self.batches.append(batch)
        return batch

    def prefix_ready(self, handle: object) -> bool:
        assert isinstance(handle, Batch)
        return handle.done

    def launch_mixed(self, slot: int, step: StepInputs, after: object | None = None) -> None:
        pass

    def launch_decode(self, slot: int, step: StepInputs) -> None:
        pass

    def finalize(
        self, slot: int, fin: np.ndarray, constrained: bool, regions: bool, greedy: bool = False
    ) -> None:
        pass

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        out = np.zeros((b, N_OUT), np.float32)
        out[:, O_TOKEN] = self.token
        return out
