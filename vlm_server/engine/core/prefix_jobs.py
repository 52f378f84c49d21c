"""What one batch of new image prefixes asks of the device, and where prompts ride along
(CUDA-free).

A new image's prefix (BOS + image patches) is computed on the device's prefill stream. The
first request for that image may send its prompt with it: the prompt's tokens then join the
BOS + image forward as extra rows, causal over the prefix and over each other, so the prompt
costs no step of its own (a step streams every weight of the decoder once, the prompt's
tokens added to a prefix forward of hundreds of positions cost a few percent of it). The
hidden state of the prompt's last token is kept on the device (the runtime's ``held``
buffer, at the sequence's row); the sequence's first output is sampled from it by the next
step, as a row with no token of its own (core/step_plan.py).

The prompt writes its keys and values into the sequence's own pages. When the prefix ends in
a partly filled page, the sequence's first own page stands in for it during the forward (the
prefix's last positions are written there, and the prompt continues in it); afterwards that
page is copied into the cache entry's last page, so later users of the entry find the prefix
whole.

`pack_prompts` lays out the prompt tokens of a batch:

    tokens [P, 3] int64: job index | position | token id (core/step_plan.py's columns)
    last   [k]    int64: index in ``tokens`` of each job's last prompt token, -1 without one
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vlm_server.engine.core.step_plan import N_TOK, T_ID, T_POS, T_ROW

if TYPE_CHECKING:
    from image_pipeline import HostImage, PreparedImage


@dataclass(frozen=True)
class PrefixPrompt:
    """A prompt computed with its image's prefix."""

    row: int  # the sequence's block-table row: where its last token's hidden state is kept
    ids: np.ndarray  # the prompt's token ids, int64 (read-only)
    # The sequence's pages in position order up to its prompt's end: the prefix entry's full
    # pages, then its own (the first standing in for the entry's partly filled last page).
    pages: tuple[int, ...]


@dataclass(frozen=True)
class PrefixJob:
    """One new image prefix of a batch: BOS + image into the cache entry's ``pages``. Values
    only: on CUDA a launcher thread reads it after the scheduler moved on."""

    pages: tuple[int, ...]
    image: PreparedImage | HostImage
    prompt: PrefixPrompt | None = None
    adapter_slot: int = -1  # the device slot of its request's adapter (-1: none)


def pack_prompts(jobs: list[PrefixJob], prefix_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt tokens of ``jobs`` in job order (see the module docstring)."""
    prompts = [(j, job.prompt) for j, job in enumerate(jobs) if job.prompt is not None]
    total = sum(len(p.ids) for _, p in prompts)
    tokens = np.empty((total, N_TOK), np.int64)
    last = np.full(len(jobs), -1, np.int64)
    at = 0
    for j, prompt in prompts:
        n = len(prompt.ids)
        if not n:
            raise ValueError(f"job {j} has an empty prompt")
        block = tokens[at : at + n]
        block[:, T_ROW] = j
        block[:, T_POS] = np.arange(prefix_len, prefix_len + n)
        block[:, T_ID] = prompt.ids
        at += n
        last[j] = at - 1
    return tokens, last


def tail_copies(jobs: list[PrefixJob], prefix_pages: int, has_tail: bool) -> list[tuple[int, int]]:
    """(source, destination) pages copied after the forward: each prompt's stand-in page into
    its entry's partly filled last page."""
    if not has_tail:
        return []
    return [
        (job.prompt.pages[prefix_pages - 1], job.pages[-1])
        for job in jobs
        if job.prompt is not None
    ]
