"""Phi-style text decoder with a pluggable KV cache.

The decoder returns the raw residual stream (before ``post_ln``): the region heads read that,
and `TextDecoder.logits` applies the final norm and the untied ``lm_head`` on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common import fused_products
from vlm_server.models.common.attention import attend, split_heads
from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import MLP, LayerNorm
from vlm_server.models.common.rotary import rotary_tables
from vlm_server.models.kv import KVCache
from vlm_server.models.lora import products as lora_products
from vlm_server.models.lora.bank import LoraBatch
from vlm_server.models.lora.spec import LoraDelta, LoraTargets
from vlm_server.models.moondream2.config import TextConfig


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q [B, H, T, hd], k and v [B, KVH, T, hd]; rotary applied to q and k."""
        return self.split_qkv(self.qkv(x), cos, sin)

    def split_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed projection [B, T, (H + 2 KVH) hd] -> q, k, v as `project_qkv` returns."""
        cfg = self.cfg
        return split_heads(qkv, cos, sin, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x), cos, sin, positions, cache, layer))

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        """The packed projection [B, T, (H + 2 KVH) hd] -> attention output [B, T, H hd]
        (proj's input), keys and values written to ``cache``."""
        cfg = self.cfg
        return attend(
            qkv, cos, sin, positions, cache, layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        )


class TextBlock(nn.Module):
    """Parallel block: x + attn(LN(x)) + mlp(LN(x)), one shared LayerNorm."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.ln = LayerNorm(cfg.dim)
        self.attn = TextAttention(cfg)
        self.mlp = MLP(cfg.dim, cfg.ff_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, cos, sin, positions, cache, layer) + self.mlp(h)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dim))
        self.blocks = nn.ModuleList(TextBlock(cfg) for _ in range(cfg.n_layers))
        self.post_ln = LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size)
        self.reset_rotary(None)
        self._stacked: list[fused_products.BlockProducts] | None = None

    def use_fused_products(self, enabled: bool = True) -> bool:
        """Serve few-row forwards (decode steps) with two fused products per block instead of
        four (models/common/fused_products.py); returns whether they are on (CUDA only)."""
        if not enabled or not fused_products.skinny_gemm.AVAILABLE or not self.wte.is_cuda:
            self._stacked = None
            return False
        # Quantized blocks stack too, but not a block mixing 16-bit and quantized linears.
        parts = [(b.attn.qkv, b.mlp.fc1, b.attn.proj, b.mlp.fc2) for b in self.blocks]
        if not all(fused_products.stackable(*p) for p in parts):
            return False
        if self._stacked is None:
            self._stacked = [fused_products.stack_block(*p) for p in parts]
        return True

    def reset_rotary(self, device: torch.device | str | None) -> None:
        """(Re)build the fp32 rotary tables, e.g. after loading onto a device from meta."""
        cos, sin = rotary_tables(
            self.cfg.rotary_dim, self.cfg.max_context, self.cfg.rope_theta, device=device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    @property
    def lora_targets(self) -> LoraTargets:
        """The linear layers an adapter adds to (models/lora/spec.py), with their widths."""
        cfg = self.cfg
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        return LoraTargets(
            cfg.n_layers,
            {
                "qkv": (cfg.dim, qkv),
                "proj": (cfg.dim, cfg.dim),
                "fc1": (cfg.dim, cfg.ff_dim),
                "fc2": (cfg.ff_dim, cfg.dim),
            },
            shared=(("qkv", "proj", "fc1"),),  # all three read the block's normed input
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        """Input embeddings x [B, T, D] at positions [B, T] -> hidden [B, T, D] before post_ln;
        ``lora``: adapter deltas (models/lora/spec.py) for these tokens."""
        blocks = self.blocks
        packed = cache.attend_packed
        if (
            self._stacked is not None
            and (lora is None or (lora.fused and self._stacked[0].takes_shrinks))
            and packed is not None
            and fused_products.usable(x)
        ):
            return self._fused_forward(x, positions, packed, lora)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = blocks[0].ln(x)
        # Each block's forward, with its residual adds fused into the next block's norm.
        for i, block in enumerate(blocks):
            if lora is None:
                a, m = block.attn(h, cos, sin, positions, cache, i), block.mlp(h)
            else:
                a, m = _lora_block(block, h, cos, sin, positions, cache, i, lora)
            if i + 1 < len(blocks):
                x, h = add_layernorm(x, a, m, blocks[i + 1].ln)
            else:
                x = x + a + m
        return x

    def _fused_forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[..., torch.Tensor],
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        """`forward` for few rows: per block one product for QKV and the hidden layer, the
        fused attention, one product for the branch, the residual add fused into the norm.
        ``lora`` (one whose deltas run in place: `LoraBatch.fused`): the shrinks ride the
        first product and the expand (models/lora/products.py), qkv's and fc1's deltas added
        into the first product (fc1's GELU applied with them, fc2's shrink computed from the
        result), proj's and fc2's into the branch (its first split sum where the product
        splits K)."""
        blocks, stacked = self.blocks, self._stacked
        assert stacked is not None
        assert lora is None or isinstance(lora, LoraBatch)
        h = blocks[0].ln(x)
        for i, prod in enumerate(stacked):
            last = i + 1 == len(blocks)
            pending = None
            if lora is None:
                if not last and fused_products.forks_mlp(h):
                    pending = prod.start_mlp(h)  # the MLP beside QKV and the attention
                    qkv = prod.qkv(h)
                else:
                    qkv, hidden = prod.qkv_and_hidden(h)
                    if fused_products.PARALLEL_BRANCH and not last:
                        pending = prod.start_branch(hidden)  # fc2's share beside the attention
            else:
                qkv, hidden, shrinks = lora_products.block_inputs(prod, lora, i, h)
            out = attend(i, qkv, positions)
            b, _, t, _ = out.shape
            attn = out.transpose(1, 2).reshape(b, t, -1)
            if lora is None:
                if last:
                    x = x + prod.branch(attn, hidden)
                elif pending is not None:
                    x, h = prod.add_branch_and_norm_after(x, attn, pending, blocks[i + 1].ln)
                else:
                    x, h = prod.add_branch_and_norm(x, attn, hidden, blocks[i + 1].ln)
            elif last:
                x = x + lora_products.branch(prod, lora, i, attn, hidden, shrinks)
            else:
                parts, delta = lora_products.branch_and_delta(prod, lora, i, attn, hidden, shrinks)
                x, h = prod.add_parts_and_norm(x, parts, blocks[i + 1].ln, delta)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and untied head; computed in fp32 for stable sampling."""
        normed = self.post_ln(hidden)
        if self._stacked is not None and fused_products.usable(normed):
            # Few rows: the head's 100 MB read as one skinny product (rounded to the model's
            # dtype as the cuBLAS product is, then widened).
            head = self.lm_head
            return fused_products.skinny_gemm.skinny_linear(normed, head.weight, head.bias).float()
        return self.lm_head(normed).float()


def _lora_block(
    block: TextBlock,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache,
    layer: int,
    lora: LoraDelta,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's attention and MLP outputs with adapter deltas, each added to its own
    layer's output as the reference does. qkv's, proj's and fc1's deltas all read the normed
    input ``h`` (proj's too: the reference's rule, not the attention output proj reads), so
    one shrink serves the three; fc1 runs before attention so that its delta and qkv's are
    added in one expand (which also applies the GELU: not the fused fc1 + GELU GEMM, the
    delta comes first), and proj's beside fc2's in another."""
    attn, mlp = block.attn, block.mlp
    qkv, fc1 = attn.qkv(h), mlp.fc1(h)
    shared = lora.shrink(layer, h, ("qkv", "proj", "fc1"))
    qkv, g = lora.expand(layer, [(shared, "qkv", qkv), (shared, "fc1", fc1)], gelu_last=True)
    a, m = attn.proj(attn.attend(qkv, cos, sin, positions, cache, layer)), mlp.fc2(g)
    hidden = lora.shrink(layer, g, ("fc2",))
    a, m = lora.expand(layer, [(shared, "proj", a), (hidden, "fc2", m)])
    return a, m
