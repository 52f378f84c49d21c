"""What the scheduler needs from a device runtime, as a structural type.

`ModelRuntime` (the real model on CUDA or the CPU) and the fake device runtime used by the
pipeline tests both satisfy it, so the scheduler runs unchanged on either.

The contract every implementation keeps: `launch_mixed`, `launch_decode` and `finalize` only
enqueue device work and return at once; none of them waits for the device. What they get of a
step are values built at launch (`StepInputs`, core/step_inputs.py, and the ``fin`` array), never
a sequence: the scheduler moves its sequences on while their steps are still queued.
`read_outputs` is the one place the host waits, and only for the device-to-host copy of the one
step it reads. Each slot's buffers and events are reused only after the scheduler committed the
step that used them (see core/pipeline.py), so an implementation needs no further waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from vlm_server.engine.core.prefix_jobs import PrefixJob
    from vlm_server.engine.core.step_inputs import StepInputs


@runtime_checkable
class Runtime(Protocol):
    """The device side of the engine, seen from the scheduler."""

    # Pages in the KV pool (the sink page included): the scheduler's page allocator hands
    # them out (core/pages.py).
    kv_pages: int
    # The host mirror of the block table [rows, pages per row] (pinned memory) the allocator
    # writes rows into; the rows it changed go to the next launch, which uploads them.
    block_table: np.ndarray
    # Batches of image prefixes that may be in flight on the prefill stream at once.
    prefix_slots: int
    # Prompt tokens that may ride one batch of new image prefixes (0: none).
    prefix_prompt_tokens: int
    # The interactive prefill lane (ahead of the steps, for interactive pictures while
    # background work runs): its batches in flight at once, and pictures a batch (0: no lane).
    interactive_prefix_slots: int
    interactive_prefill_batch: int

    def launch_prefixes(
        self, jobs: list[PrefixJob], partitioned: bool = False, interactive: bool = False
    ) -> object:
        """Enqueue the image path and the BOS + image forward of each job on a prefill lane,
        into its pages, with the prompts that ride along (core/prefix_jobs.py); returns a
        handle for `prefix_ready`. The caller keeps at most ``prefix_slots`` batches
        unfinished on the prefill stream, and ``interactive_prefix_slots`` on the interactive
        lane (``interactive``). ``partitioned``: in the SM partition, where the runtime has
        one beside its unpartitioned prefill stream. Each lane runs its batches in order.
        No host wait."""
        ...

    def prefix_ready(self, handle: object) -> bool:
        """Whether the device finished the batch of ``handle`` (a non-blocking query)."""
        ...

    def launch_mixed(self, slot: int, step: StepInputs, after: object | None = None) -> None:
        """Enqueue one mixed step into ``slot``: one forward over the decode rows and prompt
        chunks of ``step`` (see core/step_plan.py; every image prefix they read is ready, or its
        batch is ``after``, a `launch_prefixes` handle the step waits for on the device); the
        last token's hidden state of each row (a held row's: the one its prefix batch left)
        lands in the slot for finalize. The block-table rows ``step`` changed go up before the
        forward reads them. No host wait."""
        ...

    def launch_decode(self, slot: int, step: StepInputs) -> None:
        """Enqueue one decode forward of ``step``'s rows (row order = batch order) into
        ``slot``; each row reads its next input where the previous finalize wrote it on the
        device. Block-table rows as for `launch_mixed`. No host wait."""
        ...

    def finalize(
        self,
        slot: int,
        fin: np.ndarray,
        constrained: bool,
        regions: bool,
        greedy: bool = False,
    ) -> None:
        """Enqueue mask upload, sampling, region values, next inputs and the result copy to the
        host for the step in ``slot``; ``fin`` [B, N_FIN] (one row per step row,
        core/step_layout.py) was built from committed state and is copied before this
        returns. No host wait."""
        ...

    def read_outputs(self, slot: int, b: int) -> np.ndarray:
        """Wait for the device-to-host copy of the step in ``slot`` (the tick's single host
        wait) and return its first ``b`` output rows, valid until the slot is reused."""
        ...
