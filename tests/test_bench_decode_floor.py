"""The decode floor's byte count (CPU): dense weights once, the experts a step's tokens
route to in expectation, the KV its rows attend to."""

from __future__ import annotations

import torch

from bench.decode_floor import step_bytes
from vlm_server.models.registry import preset, random_model


def test_step_bytes_counts_dense_weights_routed_experts_and_kv() -> None:
    loaded = random_model(preset("md3-tiny"), seed=0, dtype=torch.float32, progress=False)
    text, moe = loaded.model.text, loaded.config.text.moe
    e, k = moe.n_experts, moe.top_k
    banks = [m for m in text.modules() if getattr(m, "weight", None) is not None
             and m.weight.dim() == 3 and m.weight.shape[0] == e]  # fmt: skip
    assert banks
    expert = sum(m.weight.numel() * 4 for m in banks)
    dense = sum(p.numel() * 4 for n, p in text.named_parameters() if not n.endswith("wte")) - expert
    one = step_bytes(text, 1, 100, 8, e, k)
    assert one == dense + expert * k / e + 100 * 8
    many = step_bytes(text, 10_000, 0, 8, e, k)
    assert abs(many - (dense + expert)) < 1e-6 * expert  # every expert touched
    # A dense model: every weight but the embeddings, whatever the rows.
    md2 = random_model(preset("tiny"), seed=0, dtype=torch.float32, progress=False).model.text
    dense2 = sum(p.numel() * 4 for n, p in md2.named_parameters() if not n.endswith("wte"))
    assert step_bytes(md2, 3, 10, 2) == dense2 + 3 * 10 * 2


def test_step_bytes_counts_quantized_experts_and_linears_at_their_bits() -> None:
    loaded = random_model(
        preset("md3-tiny"), seed=0, dtype=torch.float32, progress=False, weights="int8"
    )
    text, moe = loaded.model.text, loaded.config.text.moe
    e, k = moe.n_experts, moe.top_k
    held = {n: t for n, t in text.state_dict().items() if n.endswith((".qweight", ".scale"))}
    assert any(".mlp.fc1.qweight" in n and t.dim() == 3 for n, t in held.items())  # experts
    stored = sum(t.numel() * t.element_size() for t in held.values())
    rest = sum(p.numel() * 4 for n, p in text.named_parameters() if not n.endswith("wte"))
    many = step_bytes(text, 10_000, 0, 8, e, k)  # every expert touched
    assert abs(many - (rest + stored)) < 1e-6 * stored
    assert step_bytes(text, 1, 0, 8, e, k) < many
