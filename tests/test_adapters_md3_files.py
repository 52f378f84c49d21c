"""Moondream 3 finetune adapters on their own: the cloud's checkpoint format (``.pt`` with a
``lora_state_dict``, flat ``.pt`` and safetensors; any key prefix), its refusals naming the
tensor, and the expert deltas' arithmetic: the MoE layer with an adapter against the formula
computed one token and one chosen expert at a time, and the bank's batched forms against
the reference's row-by-row one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vlm_server.models.lora import finetune_files, formats
from vlm_server.models.lora.experts import ExpertLoraBank, gathered_lora, pair_index
from vlm_server.models.lora.files import AdapterError
from vlm_server.models.lora.spec import AdapterWeights, LoraTargets, SingleLora
from vlm_server.models.lora.writer import random_finetune
from vlm_server.models.moondream3.config import MoeConfig
from vlm_server.models.moondream3.moe import MoeMLP
from vlm_server.models.registry import preset, random_model

RANK = 6  # md3-tiny routes each token to 3 experts: 2 per expert


@pytest.fixture(scope="module")
def targets() -> LoraTargets:
    model = random_model(preset("md3-tiny"), seed=1, dtype=torch.float32, progress=False).model
    return model.text.lora_targets


def _state(
    targets: LoraTargets, rank: int = RANK, seed: int = 0, prefix: str = "text_lora."
) -> dict:
    return random_finetune(targets, rank, seed=seed, prefix=prefix)["lora_state_dict"]


def _check(state: dict, targets: LoraTargets, max_rank: int = 32) -> AdapterWeights:
    return finetune_files.validate(state, targets, max_rank, "ft@1")


def test_the_tiny_targets_follow_the_config(targets: LoraTargets) -> None:
    ex = targets.experts
    assert targets.format == "finetune" and targets.n_layers == 2
    assert targets.targets == {"fc1": (64, 256), "fc2": (256, 64)}
    assert ex is not None and (ex.first_layer, ex.n_layers, ex.n_experts, ex.top_k) == (2, 2, 8, 3)
    assert ex.targets == {"fc1": (64, 64), "fc2": (32, 64)}  # fc1 writes 2 x the expert width


@pytest.mark.parametrize("prefix", ["text_lora.", "_text.", "", "model.lora.text_lora."])
def test_keys_are_known_by_their_ends(targets: LoraTargets, prefix: str) -> None:
    state = _state(targets, prefix=prefix)
    w = _check(state, targets)
    assert w.rank == RANK and len(w.pairs) == 2 and len(w.experts) == 2
    up_a, up_b = w.experts[1]["fc1"]
    assert torch.equal(up_a, state[f"{prefix}moe.1.up_a"])
    assert torch.equal(up_b, state[f"{prefix}moe.1.up_b"])
    assert torch.equal(w.pairs[0]["fc2"][0], state[f"{prefix}dense.0.down_a"])


def test_one_module_saved_under_two_names_reads_once(targets: LoraTargets) -> None:
    """The author's engine registers the text LoRA as ``_text`` and ``text_lora``: a state
    dict of it holds each tensor twice. Equal copies are one tensor; differing ones refused."""
    one = _state(targets, prefix="text_lora.")
    both = {**one, **{k.replace("text_lora.", "_text."): v for k, v in one.items()}}
    assert _check(both, targets).rank == RANK
    both["_text.moe.0.down_b"] = both["_text.moe.0.down_b"] + 1
    with pytest.raises(AdapterError, match=r"'text_lora.moe.0.down_b' and '_text.moe.0.down_b'"):
        _check(both, targets)


def test_the_rank_comes_from_an_up_a(targets: LoraTargets) -> None:
    state = _state(targets, rank=9)
    assert _check(state, targets).rank == 9
    experts_only = {k: v for k, v in state.items() if ".moe." in k}
    w = _check(experts_only, targets)
    assert w.rank == 9 and w.pairs == [{}, {}]  # no dense deltas: they add nothing


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            # the rank comes from dense.0.up_a: 4 does not split over 3 experts per token
            lambda s, t: {**s, "text_lora.dense.0.up_a": torch.zeros(4, 64)},
            "rank 4 is not divisible by the 3 experts per token",
        ),
        (lambda s, t: _state(t, rank=36), "rank 36; max_adapter_rank is 32"),
        (
            lambda s, t: {**s, "text_lora.moe.1.up_b": s["text_lora.moe.1.up_b"][:, :-1]},
            r"'text_lora.moe.1.up_b' has shape \(8, 63, 2\).*\(8, 64, 2\)",
        ),
        (
            lambda s, t: {**s, "text_lora.moe.0.down_a": s["text_lora.moe.0.down_a"][:7]},
            r"'text_lora.moe.0.down_a' has shape \(7, 2, 32\).*\(8, 2, 32\)",
        ),
        (
            lambda s, t: {**s, "text_lora.dense.1.up_b": s["text_lora.dense.1.up_b"][:, :3]},
            r"'text_lora.dense.1.up_b' has shape \(256, 3\).*\(256, 6\)",
        ),
        (
            # every expert tensor must carry rank / 3 (here 3 instead of 2)
            lambda s, t: {**s, "text_lora.moe.0.up_a": torch.zeros(8, 3, 64)},
            r"'text_lora.moe.0.up_a' has shape \(8, 3, 64\)",
        ),
        (
            lambda s, t: {k: v for k, v in s.items() if k != "text_lora.dense.0.down_b"},
            r"dense.0.down_b is missing \(beside 'text_lora.dense.0.down_a'\)",
        ),
        (
            lambda s, t: {**s, "text_lora.moe.2.up_a": s["text_lora.moe.1.up_a"]},
            "the model has 2 expert layers",
        ),
        (
            lambda s, t: {**s, "text_lora.dense.2.up_a": s["text_lora.dense.1.up_a"]},
            "the model has 2 dense layers",
        ),
        (
            lambda s, t: {**s, "vision_lora.proj_fc2.up": torch.zeros(64, 4)},
            "unexpected tensor 'vision_lora.proj_fc2.up'",
        ),
        (
            lambda s, t: {**s, "text_lora.dense.0.up_a": torch.full((6, 64), float("nan"))},
            "'text_lora.dense.0.up_a' holds inf or NaN",
        ),
        (
            lambda s, t: {**s, "text_lora.moe.1.down_b": torch.ones(8, 64, 2, dtype=torch.int64)},
            "must be a float tensor",
        ),
        (lambda s, t: {}, "holds no LoRA tensors"),
    ],
)
def test_bad_finetunes_are_refused_naming_the_tensor(
    targets: LoraTargets, change, words: str
) -> None:  # type: ignore[no-untyped-def]
    state = change(_state(targets), targets)
    with pytest.raises(AdapterError, match=words) as err:
        _check(state, targets)
    assert "'ft@1'" in str(err.value)


def test_checkpoint_flat_and_safetensors_files_read_alike(
    targets: LoraTargets, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    checkpoint = random_finetune(targets, RANK, seed=4)
    checkpoint["step"] = 100  # a training checkpoint's other entries are not LoRA
    torch.save(checkpoint, tmp_path / "a.pt")
    state = checkpoint["lora_state_dict"]
    torch.save(state, tmp_path / "b.pt")
    save_file(state, tmp_path / "c.safetensors")
    read = [formats.load(tmp_path / f, targets, RANK, f) for f in ("a.pt", "b.pt", "c.safetensors")]
    for w in read[1:]:
        for mine, theirs in ((read[0].pairs, w.pairs), (read[0].experts, w.experts)):
            for la, lb in zip(mine, theirs, strict=True):
                assert all(torch.equal(la[t][i], lb[t][i]) for t in la for i in (0, 1))
    (tmp_path / "d.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(AdapterError, match="cannot read"):
        formats.load(tmp_path / "d.pt", targets, RANK, "d")
    torch.save({"lora_state_dict": {"x": 1}}, tmp_path / "e.pt")
    with pytest.raises(AdapterError, match="neither a checkpoint"):
        formats.load(tmp_path / "e.pt", targets, RANK, "e")


# ---- the arithmetic ------------------------------------------------------------------------


def _moe(seed: int, n_experts: int = 6, top_k: int = 3, dim: int = 16, width: int = 8) -> MoeMLP:
    torch.manual_seed(seed)
    moe = MoeMLP(dim, MoeConfig(start_layer=0, n_experts=n_experts, top_k=top_k, expert_dim=width))
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    return moe.requires_grad_(False)


def _naive_moe_lora(moe: MoeMLP, x: torch.Tensor, pairs: dict) -> torch.Tensor:
    """The formula, one token and one chosen expert at a time: z = W1[e] x + B1[e] A1[e] x,
    h = gelu_erf(z_a) * (z_b + 1), y = W2[e] h + B2[e] A2[e] h, out = sum of w_e y."""
    (a1, b1), (a2, b2) = pairs["fc1"], pairs["fc2"]
    w1, w2 = moe.fc1.weight, moe.fc2.weight
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = moe.router(x[n])
        top = sorted(range(logits.shape[0]), key=lambda e: -float(logits[e]))[: moe.top_k]
        weights = torch.softmax(logits[top], dim=0)
        for w, e in zip(weights, top, strict=True):
            z = w1[e] @ x[n] + b1[e] @ (a1[e] @ x[n])
            a, b = z.chunk(2)
            h = F.gelu(a) * (b + 1)
            out[n] += w * (w2[e] @ h + b2[e] @ (a2[e] @ h))
    return out


@pytest.mark.parametrize("method", ["loop", "dense"])
def test_the_expert_layer_with_an_adapter_follows_the_formula(method: str) -> None:
    moe = _moe(0)
    moe.method = method  # type: ignore[assignment]
    g = torch.Generator().manual_seed(1)
    r = 2  # per expert
    pairs = {
        "fc1": (torch.randn(6, r, 16, generator=g) * 0.3, torch.randn(6, 16, r, generator=g) * 0.3),
        "fc2": (torch.randn(6, r, 8, generator=g) * 0.3, torch.randn(6, 16, r, generator=g) * 0.3),
    }
    weights = AdapterWeights("w", 3 * r, [], [pairs])
    x = torch.randn(11, 16, generator=g)
    lora = SingleLora(weights)
    got = moe(x, lambda *args: lora.expert_delta(0, *args))
    want = _naive_moe_lora(moe, x, pairs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, moe(x), atol=1e-3)  # the adapter matters


def test_rows_without_an_adapter_equal_the_plain_layer_exactly() -> None:
    """A batch where no token uses an adapter, run with the adapter path: bit for bit the
    plain layer (the deltas add exact zeros)."""
    moe = _moe(3)
    targets = LoraTargets(0, {}, _expert_targets(moe), format="finetune")
    bank = ExpertLoraBank(targets, 2, 6, torch.float32, "cpu")
    w = finetune_files.validate(random_finetune(targets, 6)["lora_state_dict"], targets, 6, "w")
    bank.write(1, bank.staging(w), w.rank)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    none = torch.full((9,), -1, dtype=torch.int32)
    for method in ("loop", "dense"):
        moe.method = method  # type: ignore[assignment]
        got = moe(x, lambda *a: bank.expert_delta(none, 0, *a))
        assert torch.equal(got, moe(x)), method


def _expert_targets(moe: MoeMLP):  # type: ignore[no-untyped-def]
    from vlm_server.models.lora.spec import ExpertTargets

    n_experts, two_width, dim = moe.fc1.weight.shape
    targets = {"fc1": (dim, two_width), "fc2": (two_width // 2, dim)}
    return ExpertTargets(0, 1, n_experts, moe.top_k, targets)


def test_the_bank_forms_equal_the_reference_row_by_row() -> None:
    """Slots of different ranks; rows of tokens with each slot, none, and padding: the CPU's
    exact form and the gathered form (CUDA without Triton) equal the reference's rows."""
    moe = _moe(5)
    targets = LoraTargets(0, {}, _expert_targets(moe), format="finetune")
    bank = ExpertLoraBank(targets, 3, 9, torch.float32, "cpu")
    adapters = []
    for slot, rank in enumerate((9, 3, 6)):
        state = random_finetune(targets, rank, seed=slot, scale=0.3)["lora_state_dict"]
        w = finetune_files.validate(state, targets, 9, f"w{slot}")
        bank.write(slot, bank.staging(w), w.rank)
        adapters.append(SingleLora(w))
    g = torch.Generator().manual_seed(7)
    index = torch.tensor([2, -1, 0, 1, 0], dtype=torch.int32)  # each token's slot
    rows = 23
    tokens = torch.randint(-1, 5, (rows,), generator=g)
    experts = torch.randint(0, 6, (rows,), generator=g)
    for target, (n_in, _) in targets.experts.targets.items():  # type: ignore[union-attr]
        x = torch.randn(rows, n_in, generator=g)
        want = torch.zeros(rows, bank.eb[target].shape[3])
        for i in range(rows):
            t = int(tokens[i])
            if t >= 0 and index[t] >= 0:
                ref = adapters[int(index[t])]
                one = ref.expert_delta(
                    0, target, x[i : i + 1], experts[i : i + 1], tokens[i : i + 1]
                )
                want[i] = one[0]
        got = bank.expert_delta(index, 0, target, x, experts, tokens)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        n_pairs = 3 * 6
        a = bank.ea[target][0].view(n_pairs, bank.expert_rank, -1)
        b = bank.eb[target][0].view(n_pairs, -1, bank.expert_rank)
        gathered = gathered_lora(x, a, b, pair_index(index, experts, tokens, 6))
        torch.testing.assert_close(gathered, want, atol=1e-5, rtol=1e-5)


def test_an_expert_bank_needs_a_rank_per_expert() -> None:
    moe = _moe(0, top_k=3)
    targets = LoraTargets(0, {}, _expert_targets(moe), format="finetune")
    with pytest.raises(ValueError, match="max_adapter_rank 2 is below the 3 experts per token"):
        ExpertLoraBank(targets, 2, 2, torch.float32, "cpu")
