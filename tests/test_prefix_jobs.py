"""The layout of prompts riding their image prefix, and held rows in a step's plan."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vlm_server.engine.core.prefix_jobs import PrefixJob, PrefixPrompt, pack_prompts, tail_copies
from vlm_server.engine.core.step_plan import (
    HELD,
    N_TOK,
    T_ID,
    T_POS,
    T_ROW,
    Chunk,
    StepPlan,
    pack_tokens,
)

PREFIX = 10  # positions of BOS + image; pages of 4: the third page is partly filled


def _job(
    pages: list[int], prompt: list[int] | None, row: int = 0, own: list[int] = ()
) -> PrefixJob:
    rider = None
    if prompt is not None:
        rider = PrefixPrompt(row, np.asarray(prompt, np.int64), pages[:-1] + list(own))
    return PrefixJob(pages, image=None, prompt=rider)  # type: ignore[arg-type]


def test_prompts_follow_their_prefix_in_job_order() -> None:
    jobs = [
        _job([1, 2, 3], [7, 8, 9], row=5, own=[20, 21]),
        _job([4, 5, 6], None),
        _job([10, 11, 12], [3], row=2, own=[30]),
    ]
    tokens, last = pack_prompts(jobs, PREFIX)
    assert tokens.shape == (4, N_TOK)
    assert tokens[:, T_ROW].tolist() == [0, 0, 0, 2]  # the job index: its pages row
    assert tokens[:, T_POS].tolist() == [10, 11, 12, 10]
    assert tokens[:, T_ID].tolist() == [7, 8, 9, 3]
    assert last.tolist() == [2, -1, 3]


def test_no_prompt_packs_nothing_and_an_empty_prompt_is_refused() -> None:
    tokens, last = pack_prompts([_job([1, 2, 3], None)], PREFIX)
    assert tokens.shape == (0, N_TOK) and last.tolist() == [-1]
    with pytest.raises(ValueError, match="empty prompt"):
        pack_prompts([_job([1, 2, 3], [])], PREFIX)


def test_each_stand_in_page_is_copied_into_its_entrys_last_page() -> None:
    jobs = [_job([1, 2, 3], [7], row=5, own=[20, 21]), _job([4, 5, 6], None)]
    assert tail_copies(jobs, prefix_pages=3, has_tail=True) == [(20, 3)]
    assert tail_copies(jobs, prefix_pages=3, has_tail=False) == []


def test_a_held_row_has_no_token_and_points_at_its_row() -> None:
    seqs = [
        SimpleNamespace(
            row=3, prefix_len=0, prompt_ids=np.zeros(0, np.int64), next_position=lambda: 9
        ),
        SimpleNamespace(row=6, prefix_len=PREFIX, prompt_ids=np.arange(5, dtype=np.int64)),
        SimpleNamespace(row=1, prefix_len=PREFIX, prompt_ids=np.arange(5, dtype=np.int64)),
    ]
    plan = StepPlan(1, [Chunk.held(5), Chunk(0, 2, False)])
    tokens, last = pack_tokens(seqs, plan)  # type: ignore[arg-type]
    assert len(tokens) == 3  # the decode row's token and the chunk's two: none for the held row
    assert last.tolist() == [0, HELD - 6, 2]
    assert plan.samples(1) and plan.ends_prefill(1) and not plan.samples(2)
