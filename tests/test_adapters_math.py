"""Adapter pieces on their own: the batched delta's three PyTorch forms agree with the
reference's arithmetic, the slot LRU, ids, key renames and file checks."""

from __future__ import annotations

import pytest
import torch

from vlm_server.engine.core.adapter_slots import AdapterSlots
from vlm_server.models.lora import files
from vlm_server.models.lora.bank import LoraBank, exact_lora, masked_lora, segmented_lora
from vlm_server.models.lora.spec import LoraTargets, SingleLora
from vlm_server.models.lora.writer import random_state

TARGETS = LoraTargets(2, {"qkv": (16, 48), "proj": (16, 16), "fc1": (16, 64), "fc2": (64, 16)})


def _weights(seed: int, rank: int) -> files.AdapterWeights:
    state = random_state(TARGETS, rank, seed=seed)
    return files.validate({files.rename(k): v for k, v in state.items()}, TARGETS, 8, f"w{seed}")


def test_the_batched_forms_equal_the_reference_per_token() -> None:
    bank = LoraBank(TARGETS, 3, 8, torch.float32, "cpu")
    adapters = [_weights(s, r) for s, r in ((0, 8), (1, 3), (2, 5))]
    for slot, w in enumerate(adapters):
        bank.write(slot, bank.staging(w), w.rank)
    g = torch.Generator().manual_seed(0)
    length, k = 5, 4
    slots = torch.tensor([2, -1, 0, 2], dtype=torch.int32)
    index = slots.repeat_interleave(length)
    for target, (n_in, _) in TARGETS.targets.items():
        x = torch.randn(k * length, n_in, generator=g)
        a, b = bank.a[target][:, 1], bank.b[target][:, 1]
        want = torch.stack(
            [
                SingleLora(adapters[s]).add(1, target, x[t], torch.zeros(b.shape[1]))
                if s >= 0
                else torch.zeros(b.shape[1])
                for t, s in enumerate(index.tolist())
            ]
        )
        for got in (
            exact_lora(x, a, b, index, bank.ranks),
            masked_lora(x, a, b, index),
            segmented_lora(x, a, b, slots, length),
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_slots_reuse_the_least_recently_used_unpinned_one() -> None:
    slots = AdapterSlots(2)
    a, b = slots.claim(), slots.claim()
    slots.filled(a, "a")
    slots.filled(b, "b")
    assert slots.claim() is None  # both pinned by their loads
    slots.unpin(a)
    slots.unpin(b)
    assert slots.pin("a") == a  # a is now the most recently used
    slots.unpin(a)
    c = slots.claim()
    assert c == b and slots.evictions == 1  # b was the least recently used
    slots.filled(c, "c")
    assert [n for n, _ in slots.resident()] == ["a", "c"]
    assert slots.pin("b") is None
    with pytest.raises(AssertionError):
        slots.unpin(a)


@pytest.mark.parametrize("good", ["ft1", "ft1@100", "a.b-c_d", "x" * 128])
def test_ids_that_are_names(good: str) -> None:
    assert files.check_id(good) == good


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x@", "@1", "a b", "x" * 129, "a..b"])
def test_ids_that_are_not(bad: str) -> None:
    with pytest.raises(files.AdapterError, match="not a name"):
        files.check_id(bad)


def test_the_reference_renames() -> None:
    key = "text_model.transformer.h.3.mixer.out_proj.parametrizations.weight.0.B"
    assert files.rename(key) == "text.blocks.3.attn.proj.B"
    assert files.rename("text.blocks.0.mlp.fc1.A") == "text.blocks.0.mlp.fc1.A"


def test_file_checks_name_the_tensor() -> None:
    state = {files.rename(k): v for k, v in random_state(TARGETS, 2).items()}
    half = dict(state)
    del half["text.blocks.1.mlp.fc1.B"]
    with pytest.raises(files.AdapterError, match=r"'w'.*text.blocks.1.mlp.fc1.B is missing"):
        files.validate(half, TARGETS, 8, "w")
    extra = {**state, "text.blocks.2.attn.qkv.A": state["text.blocks.0.attn.qkv.A"]}
    with pytest.raises(files.AdapterError, match="has 2 layers"):
        files.validate(extra, TARGETS, 8, "w")
    wrong = {**state, "text.blocks.0.mlp.qkv.A": state["text.blocks.0.attn.qkv.A"]}
    with pytest.raises(files.AdapterError, match=r"mlp\.qkv is no target"):
        files.validate(wrong, TARGETS, 8, "w")
    nan = dict(state)
    nan["text.blocks.0.attn.proj.A"] = torch.full_like(nan["text.blocks.0.attn.proj.A"], torch.nan)
    with pytest.raises(files.AdapterError, match="inf or NaN"):
        files.validate(nan, TARGETS, 8, "w")
    with pytest.raises(files.AdapterError, match="max_adapter_rank is 1"):
        files.validate(state, TARGETS, 1, "w")
