"""Moondream 3's text decoder: parallel blocks, tau-scaled attention, dense then expert MLPs.

Like Moondream 2's decoder it returns the raw residual stream (before ``post_ln``) and
`TextDecoder.logits` applies the final norm and the untied head (with bias). Attention is
Moondream 2's (common/attention.py: multi-head, half-split partial rotary, scale
1/sqrt(head_dim), the prefix seen both ways) on a tau-scaled projection, so the engine's fused
rotary + attention kernels take it as they take Moondream 2's: only the rotary tables (theta
1.5e6) differ, and those are ours.

Finetune adapters (models/lora/) cover the MLPs only: the dense layers' fc1 and fc2, and every
expert's in the expert layers (`lora_targets`); the cloud finetunes' checkpoint format.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common import skinny_gemm
from vlm_server.models.common.attention import attend
from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import MLP, LayerNorm, gelu_tanh
from vlm_server.models.common.rotary import rotary_tables
from vlm_server.models.kv import KVCache
from vlm_server.models.lora.spec import ExpertTargets, LoraDelta, LoraTargets
from vlm_server.models.moondream3.config import DisputedPoints, TextConfig
from vlm_server.models.moondream3.moe import MoeMLP
from vlm_server.models.moondream3.moe_norm import add_combine_layernorm
from vlm_server.models.moondream3.tau import Tau

# An expert layer's combine inside the next block's residual add and norm (moe_norm.py) on
# the fused expert path; False runs it as its own kernel (kept for A/B runs).
FUSED_COMBINE = True
# With the fused products on (`use_fused_products`), steps of few rows run the attention's
# QKV and output products, the routers' and the dense layers' fc1 + GELU and fc2 through the
# skinny kernel (models/common/skinny_gemm.py) rather than cuBLAS, which spent 0.666 ms of an
# H100's 1.992 ms step at one stream on them (80 launches). False: cuBLAS (A/B runs).
SKINNY_PRODUCTS = True


def _product(layer: nn.Module, x: torch.Tensor, skinny: bool, gelu: bool = False) -> torch.Tensor:
    """``layer(x)`` (``gelu``: gelu_tanh of it), through the skinny kernel where ``skinny``
    and it runs there."""
    y = skinny_gemm.layer_product(layer, x, gelu=gelu) if skinny else None
    if y is not None:
        return y
    return gelu_tanh(layer(x)) if gelu else layer(x)


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig, choices: DisputedPoints) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, cfg.qkv_dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.tau = Tau(cfg, choices.tau_gelu, choices.tau_positions)
        self.skinny = False  # QKV and proj through the skinny kernel (`_product`)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.tau.scale(_product(self.qkv, x, self.skinny), positions, cfg.n_heads)
        # Tau scales whole heads, so scaling before rotary equals scaling after: a cache that
        # fuses rotary into its attention takes the scaled projection as it is.
        out = attend(
            qkv, cos, sin, positions, cache, layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        )
        return _product(self.proj, out, self.skinny)


class TextBlock(nn.Module):
    """x + attn(LN(x)) + mlp(LN(x)): one shared LayerNorm; a dense or an expert MLP."""

    def __init__(self, cfg: TextConfig, choices: DisputedPoints, layer: int) -> None:
        super().__init__()
        self.ln = LayerNorm(cfg.dim)
        self.attn = TextAttention(cfg, choices)
        self.mlp: nn.Module = (
            MoeMLP(cfg.dim, cfg.moe) if cfg.is_moe(layer) else MLP(cfg.dim, cfg.ff_dim)
        )


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig, choices: DisputedPoints) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim))
        self.blocks = nn.ModuleList(TextBlock(cfg, choices, i) for i in range(cfg.n_layers))
        self.post_ln = LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)
        self._skinny_mlp = False  # the dense layers' products through the skinny kernel
        self.reset_rotary(None)

    def reset_rotary(self, device: torch.device | str | None) -> None:
        """(Re)build the fp32 rotary tables, e.g. after loading onto a device from meta."""
        cos, sin = rotary_tables(
            self.cfg.rotary_dim, self.cfg.max_context, self.cfg.rope_theta, device=device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def use_fused_products(self, enabled: bool = True) -> bool:
        """Serve every forward's tau scaling with two kernels per layer (tau_kernel.py) instead
        of ~15 PyTorch ops and two products, and steps of few rows' 16-bit products through the
        skinny kernel (`SKINNY_PRODUCTS`); returns whether it is on (CUDA with Triton)."""
        skinny = enabled and skinny_gemm.AVAILABLE and SKINNY_PRODUCTS
        for block in self.blocks:
            block.attn.skinny = skinny
            if isinstance(block.mlp, MoeMLP):
                block.mlp.skinny_router = skinny
        self._skinny_mlp = skinny
        return all([b.attn.tau.use_kernel(enabled) for b in self.blocks])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    @property
    def lora_targets(self) -> LoraTargets:
        """What an adapter adds to (models/lora/spec.py): the dense layers' MLP, and each
        expert's of the expert layers (adapter layer j is decoder layer start_layer + j)."""
        cfg, moe = self.cfg, self.cfg.moe
        start = moe.start_layer
        experts = ExpertTargets(
            first_layer=start,
            n_layers=cfg.n_layers - start,
            n_experts=moe.n_experts,
            top_k=moe.top_k,
            targets={"fc1": (cfg.dim, 2 * moe.expert_dim), "fc2": (moe.expert_dim, cfg.dim)},
        )
        dense = {"fc1": (cfg.dim, cfg.ff_dim), "fc2": (cfg.ff_dim, cfg.dim)}
        return LoraTargets(start, dense, experts, format="finetune")

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        """Input embeddings x [B, T, D] at positions [B, T] -> hidden [B, T, D] before post_ln;
        ``lora``: adapter deltas (models/lora/spec.py) for these tokens."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        blocks = self.blocks
        h = blocks[0].ln(x)
        # Each block's forward, with its residual adds fused into the next block's norm.
        for i, block in enumerate(blocks):
            a = block.attn(h, cos, sin, positions, cache, i)
            last = i + 1 == len(blocks)
            if FUSED_COMBINE and lora is None and not last and isinstance(block.mlp, MoeMLP):
                pairs = block.mlp.pairs(h)  # the expert layer's combine joins the next norm
                if pairs is not None:
                    x, h = add_combine_layernorm(x, a, *pairs, blocks[i + 1].ln)
                    continue
            m = self._mlp(block.mlp, h) if lora is None else self._lora_mlp(block.mlp, h, lora, i)
            if not last:
                x, h = add_layernorm(x, a, m, blocks[i + 1].ln)
            else:
                x = x + a + m
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and untied head; computed in fp32 for stable sampling."""
        return self.lm_head(self.post_ln(hidden)).float()

    def _mlp(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A block's MLP; a dense one's two products through the skinny kernel where it runs
        (fc1's GELU in its epilogue)."""
        if not isinstance(mlp, MLP) or not self._skinny_mlp:
            return mlp(h)
        hidden = skinny_gemm.layer_product(mlp.fc1, h, gelu=True)
        if hidden is None:
            return mlp(h)
        return _product(mlp.fc2, hidden, True)

    def _lora_mlp(self, mlp: nn.Module, x: torch.Tensor, lora: LoraDelta, i: int) -> torch.Tensor:
        """Block ``i``'s MLP with the adapter's deltas: an expert layer's per (token, expert)
        pair; a dense layer's fc1 delta before the GELU (so not the fused fc1 + GELU GEMM),
        fc2's of the GELU's output."""
        start = self.cfg.moe.start_layer
        if isinstance(mlp, MoeMLP):
            return mlp(x, partial(lora.expert_delta, i - start))
        assert isinstance(mlp, MLP)
        h = gelu_tanh(lora.add(i, "fc1", x, mlp.fc1(x)))
        return lora.add(i, "fc2", h, mlp.fc2(h))
