"""The mixed-step planner (core/step_plan.py) and the varlen paged attention that runs it.

The budget's invariants B1-B4 hold over random workloads driven step by step the way the
scheduler drives them; the packed layout puts each token where the runtime reads it; the
PyTorch varlen attention (the CPU path and the oracle of a later kernel) equals plain masked
attention of each token over its own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.step_plan import (
    DEVICE_INPUT,
    T_ID,
    T_POS,
    T_ROW,
    Chunk,
    StepBudget,
    StepPlan,
    pack_tokens,
)
from vlm_server.engine.device.kernels.paged_attention import ragged_paged_attention
from vlm_server.models.kv import allowed_mask


@dataclass
class _Prefill:
    prompt: int  # prompt tokens
    launched: int = 0

    @property
    def done(self) -> bool:
        return self.launched == self.prompt


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(2, 64),
    work=st.lists(st.integers(1, 80), min_size=1, max_size=8),
    decode=st.lists(st.integers(0, 63), min_size=1, max_size=200),
)
def test_the_budget_keeps_its_invariants(budget: int, work: list[int], decode: list[int]) -> None:
    prefills = [_Prefill(prompt) for prompt in work]
    chunks: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(prefills))}
    for step in range(10_000):
        if all(p.done for p in prefills):
            break
        n_decode = decode[step % len(decode)] % budget  # B2: any decode batch below it fits
        b = StepBudget(budget, n_decode)
        got: list[int] = []
        for i, p in enumerate(prefills):
            if p.done:
                continue
            if not b.can_take():
                break
            n = b.take(p.prompt - p.launched)
            assert n >= 1
            chunks[i].append((p.launched, n))
            p.launched += n
            got.append(i)
        assert b.tokens <= budget  # B1: decode rows + prompt tokens
        assert b.tokens >= n_decode  # B2: every decode row is in
        oldest = next(i for i, p in enumerate(prefills) if not p.done or i in got)
        assert got and got[0] == oldest  # B3: the oldest prefill progresses every step
        for i in got[:-1]:  # B4: a later prefill gets work only once the earlier ones are done
            assert prefills[i].done
    else:
        raise AssertionError("the prefills never finished")
    for i, p in enumerate(prefills):  # B4: chunks are contiguous and in prompt order
        starts = [s for s, _ in chunks[i]]
        ends = [s + n for s, n in chunks[i]]
        assert starts[0] == 0 and ends[-1] == p.prompt and starts[1:] == ends[:-1]


def test_the_budget_holds_every_decode_row_and_a_prefill_token() -> None:
    with pytest.raises(ValueError):
        EngineConfig(max_batch_size=8, max_step_tokens=8)
    assert EngineConfig(max_batch_size=8, max_step_tokens=9).max_step_tokens == 9


def test_the_budget_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError):
        StepBudget(4, 4)  # decode rows fill it: no room for any prefill
    b = StepBudget(10, 3)
    assert b.take(5) == 5 and b.left == 2
    assert b.take(9) == 2 and not b.can_take()
    with pytest.raises(ValueError):
        b.take(1)
    with pytest.raises(ValueError):
        StepBudget(10, 3).take(0)  # a prefill with nothing left


@dataclass
class _Seq:
    row: int
    prompt: list[int]
    prefix_len: int
    position: int = 0

    @property
    def prompt_ids(self) -> np.ndarray:
        return np.asarray(self.prompt, np.int64)

    def next_position(self) -> int:
        return self.position


def test_pack_tokens_lays_out_decode_rows_then_chunks() -> None:
    seqs = [
        _Seq(5, [], 0, position=12),
        _Seq(2, [], 10, position=40),
        _Seq(7, [1, 2, 3, 4, 5], 10),  # chunk [2, 5): the last one, it samples
        _Seq(0, [8, 9], 0),  # a row without a token in this step
        _Seq(3, [6, 7, 8, 9], 0),  # chunk [0, 2): not the last
    ]
    plan = StepPlan(2, [Chunk(2, 3, final=True), Chunk(0, 0, final=False), Chunk(0, 2, False)])
    tokens, last = pack_tokens(seqs, plan)
    assert tokens[:, T_ROW].tolist() == [5, 2, 7, 7, 7, 3, 3]
    assert tokens[:, T_POS].tolist() == [12, 40, 12, 13, 14, 0, 1]
    assert tokens[:, T_ID].tolist() == [DEVICE_INPUT, DEVICE_INPUT, 3, 4, 5, 6, 7]
    assert last.tolist() == [0, 1, 4, -1, 6]
    assert [plan.samples(i) for i in range(5)] == [True, True, True, False, False]
    assert [plan.ends_prefill(i) for i in range(5)] == [False, False, True, False, False]
    assert plan.n_tokens == len(tokens) == 7
    with pytest.raises(ValueError):
        pack_tokens(seqs[:4], plan)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ragged_attention_equals_masked_attention_per_sequence(kv_heads: int) -> None:
    """Tokens of three sequences, interleaved, some inside their prefix (both ways), some
    past it (causal), over pages scattered in the pool: each equals plain attention over its
    own sequence's keys, and the query blocks do not change the result."""
    g = torch.Generator().manual_seed(0)
    ps, n_pages, heads, hd = 4, 32, 4, 8
    k_pool = torch.randn(n_pages, ps, kv_heads, hd, generator=g)
    v_pool = torch.randn(n_pages, ps, kv_heads, hd, generator=g)
    perm = torch.randperm(n_pages - 1, generator=g) + 1
    table = torch.zeros(3, 6, dtype=torch.int32)
    for r in range(3):
        table[r] = perm[6 * r : 6 * r + 6].int()
    prefix = [5, 0, 9]
    queries = [(0, 2), (0, 7), (1, 0), (1, 13), (2, 3), (2, 8), (2, 9), (2, 23), (0, 4)]
    rows = torch.tensor([r for r, _ in queries])
    pos = torch.tensor([p for _, p in queries])
    plens = torch.tensor([prefix[r] for r, _ in queries])
    q = torch.randn(len(queries), heads, hd, generator=g)
    rep = heads // kv_heads
    want = []
    for t, (r, _) in enumerate(queries):
        pages = table[r].long()
        keys = k_pool[pages].reshape(-1, kv_heads, hd).transpose(0, 1).repeat_interleave(rep, 0)
        values = v_pool[pages].reshape(-1, kv_heads, hd).transpose(0, 1).repeat_interleave(rep, 0)
        mask = allowed_mask(pos[t : t + 1][None], torch.arange(keys.shape[1]), prefix[r])[0]
        want.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[t][:, None], keys, values, attn_mask=mask
            )[:, 0]
        )
    want_t = torch.stack(want)
    for block in (64, 2):
        got = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, 6, plens, block)
        torch.testing.assert_close(got, want_t)
    causal = ragged_paged_attention(q, k_pool, v_pool, table, rows, pos, 6)
    assert not torch.allclose(causal[0], want_t[0])  # the prefix query sees ahead of itself
    torch.testing.assert_close(causal[1], want_t[1])  # past the prefix: causal either way
    assert np.isfinite(causal.numpy()).all()
