"""Parity: Moondream 3's decoder equals an independent, Hugging Face-shaped reading of the
model's formulas (docs/moondream3.md), written here over the raw state dict: the whole
sequence at once with an explicit prefix mask, rotary pairs written back interleaved (as the
Hugging Face code does), tau from the projection's GELU and the position, a token-by-token
expert loop.
Under `HF_CHOICES` (erf GELU, tau positions in the activations' dtype, no region norm,
bins / 1024) it is the Hugging Face code's behaviour; under the defaults the author's
engine's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decoding.region_values import coord_from_logits
from vlm_server.models import registry
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.moondream3.config import (
    HF_CHOICES,
    DisputedPoints,
    ModelConfig,
    with_choices,
)

EPS = 1e-5


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split pairs rotated and written back interleaved; the remaining dims pass."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rot = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return torch.cat([rot, x[..., 2 * half :]], dim=-1)


def _tau_position(alpha: torch.Tensor, t: int, bf16: bool) -> torch.Tensor:
    """[H, T]: 1 + (sigmoid(alpha ln(p + 1)) - 0.5)."""
    p = torch.arange(t, dtype=torch.bfloat16 if bf16 else torch.float32)
    a = alpha.to(p.dtype)
    return (1 + (torch.sigmoid(a[:, None] * (p + 1).log()[None, :]) - 0.5)).float()


def _expert_mlp(sd: dict, pre: str, h: torch.Tensor, top_k: int) -> torch.Tensor:
    out = torch.zeros_like(h)
    for n in range(h.shape[0]):
        logits = h[n] @ sd[pre + "router.weight"].T + sd[pre + "router.bias"]
        top, ids = logits.topk(top_k)
        for w, e in zip(torch.softmax(top, dim=0), ids.tolist(), strict=True):
            z = sd[pre + "fc1.weight"][e] @ h[n]
            a, b = z.chunk(2)
            out[n] += w * (sd[pre + "fc2.weight"][e] @ (F.gelu(a) * (b + 1)))
    return out


def hf_decoder(sd: dict, config: ModelConfig, x: torch.Tensor, prefix: int) -> torch.Tensor:
    """Embeddings [T, D] -> hidden states [T, D] before the final norm."""
    t_cfg, ch = config.text, config.choices
    n, hd, heads = x.shape[0], t_cfg.head_dim, t_cfg.n_heads
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[:prefix, :prefix] = True
    inv = t_cfg.rope_theta ** (
        -torch.arange(0, t_cfg.rotary_dim, 2, dtype=torch.float64) / t_cfg.rotary_dim
    )
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = angles.cos().float(), angles.sin().float()
    for i in range(t_cfg.n_layers):
        b = f"text.blocks.{i}."
        h = F.layer_norm(x, (x.shape[-1],), sd[b + "ln.weight"], sd[b + "ln.bias"], EPS)
        qkv = h @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"]
        g = F.gelu(qkv, approximate="tanh" if ch.tau_gelu == "tanh" else "none")
        pos = _tau_position(sd[b + "attn.tau.alpha"], n, ch.tau_positions == "bf16")
        tau_q = torch.tanh(g @ sd[b + "attn.tau.wq"].T) + pos.T
        tau_v = torch.tanh(g @ sd[b + "attn.tau.wv"].T) + pos.T
        q, k, v = (c.view(n, heads, hd).transpose(0, 1) for c in qkv.chunk(3, dim=-1))
        q = q * tau_q.T[:, :, None]
        v = v * tau_v.T[:, :, None]
        q, k = _rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        att = att.transpose(0, 1).reshape(n, -1) @ sd[b + "attn.proj.weight"].T
        att = att + sd[b + "attn.proj.bias"]
        if t_cfg.is_moe(i):
            mlp = _expert_mlp(sd, b + "mlp.", h, t_cfg.moe.top_k)
        else:
            up = F.gelu(h @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"], approximate="tanh")
            mlp = up @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
        x = x + att + mlp
    return x


def _coord_logits(sd: dict, config: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    norm = config.choices.region_norm
    if norm == "post_ln":
        hidden = F.layer_norm(hidden, (hidden.shape[-1],), sd["text.post_ln.weight"],
                              sd["text.post_ln.bias"], EPS)  # fmt: skip
    if norm != "none":
        hidden = F.layer_norm(hidden, (hidden.shape[-1],), sd["region.ln.weight"],
                              sd["region.ln.bias"], EPS)  # fmt: skip
    return hidden @ sd["region.coord_decoder.weight"].T + sd["region.coord_decoder.bias"]


@pytest.mark.parametrize(
    "choices",
    [DisputedPoints(), HF_CHOICES, DisputedPoints(region_norm="post_ln")],
    ids=["authors-engine", "hf", "vllm-region-norm"],
)
def test_the_decoder_and_region_heads_equal_the_independent_reading(
    choices: DisputedPoints,
) -> None:
    config = with_choices(registry.preset("md3-tiny"), choices)  # type: ignore[arg-type]
    loaded = registry.random_model(config, seed=5, dtype=torch.float32, progress=False)
    model = loaded.model
    sd = model.state_dict()
    prefix, n = 7, 13
    x = torch.randn(n, config.text.dim, generator=torch.Generator().manual_seed(0))
    cache = DenseKVCache(model.kv_shape, 64, 1, torch.float32, "cpu", prefix)
    # The prefix first, then the text in two pieces: what the engine's cache sees.
    parts = [(0, prefix), (prefix, 10), (10, n)]
    got = torch.cat(
        [model.text(x[None, a:b], torch.arange(a, b)[None], cache)[0] for a, b in parts]
    )
    want = hf_decoder(sd, config, x, prefix)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        model.region.decode_coord(got[-1:]), _coord_logits(sd, config, want[-1:]), atol=1e-4,
        rtol=1e-4,
    )  # fmt: skip
    divisor = 1024 if choices.coord_divisor == 1024 else 1023
    assert loaded.config.tokens.coord_divisor == divisor
    value = coord_from_logits(model.region.decode_coord(got[-1:]), divisor)
    assert round(float(value) * divisor) == int(_coord_logits(sd, config, want[-1:]).argmax())


def test_the_choices_change_the_answer() -> None:
    """Each disputed point matters on the same weights (so a parity test can tell them apart)."""
    base = registry.preset("md3-tiny")
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(1))
    outs = []
    for choices in (
        DisputedPoints(),
        DisputedPoints(tau_gelu="erf"),
        DisputedPoints(tau_positions="bf16"),
    ):
        config = with_choices(base, choices)  # type: ignore[arg-type]
        model = registry.random_model(config, seed=5, dtype=torch.float32, progress=False).model
        cache = DenseKVCache(model.kv_shape, 64, 1, torch.float32, "cpu", 4)
        outs.append(model.text(x, torch.arange(9)[None], cache))
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
