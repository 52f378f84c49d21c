"""SigLIP-like vision tower and the global+local projection into the text width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.common.config import VisionConfig
from vlm_server.models.common.fp8_vision import Fp8Tower
from vlm_server.models.common.fused_norm import add_layernorm
from vlm_server.models.common.layers import MLP, LayerNorm


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.n_heads = cfg.enc_n_heads
        self.qkv = nn.Linear(cfg.enc_dim, 3 * cfg.enc_dim)
        self.proj = nn.Linear(cfg.enc_dim, cfg.enc_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        # [n, t, 3d] -> three [n, heads, t, head_dim], in Q | K | V column order
        q, k, v = (
            c.view(n, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for c in self.qkv(x).chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class VisionBlock(nn.Module):
    """Pre-norm, sequential: attention then MLP."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.enc_dim)
        self.attn = VisionAttention(cfg)
        self.ln2 = LayerNorm(cfg.enc_dim)
        self.mlp = MLP(cfg.enc_dim, cfg.enc_ff_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VisionEncoder(nn.Module):
    """Crops [N, 3, crop, crop] (normalized to [-1, 1]) -> patch features [N, patches, enc_dim]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_emb = nn.Linear(cfg.patch_dim, cfg.enc_dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.n_patches, cfg.enc_dim))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.enc_n_layers))
        self.post_ln = LayerNorm(cfg.enc_dim)
        self.proj_mlp = MLP(2 * cfg.enc_dim, cfg.proj_inner_dim, cfg.proj_out_dim)
        # Set by `use_fp8`: the tower's FP8 weights (not part of the checkpoint's state).
        self.fp8: Fp8Tower | None = None

    def use_fp8(self, enabled: bool = True) -> None:
        """Run QKV, fc1 and fc2 as FP8 GEMMs from now on (models/common/fp8_vision.py), or not.
        Quantizes the current weights: call it after loading them, and before capturing any
        graph of the tower (a captured graph keeps reading the weights it was captured with)."""
        self.fp8 = Fp8Tower(self) if enabled else None

    def patchify(self, crops: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, grid*grid, C*p*p]; patch index py*grid+px, feature c*p*p+iy*p+ix."""
        n, c, _, _ = crops.shape
        g, p = self.cfg.grid_size, self.cfg.patch_size
        x = crops.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(n, g * g, c * p * p)

    def encode(self, crops: torch.Tensor) -> torch.Tensor:
        """Run the tower on a batch of crops (of one or many images)."""
        if self.fp8 is not None:
            return self.fp8.encode(self, crops)
        x = self.patch_emb(self.patchify(crops)) + self.pos_emb
        blocks = self.blocks
        h = blocks[0].ln1(x)
        # Each block's forward, with every residual add fused into the norm that follows it.
        for i, block in enumerate(blocks):
            x, h = add_layernorm(x, block.attn(h), None, block.ln2)
            after = blocks[i + 1].ln1 if i + 1 < len(blocks) else self.post_ln
            x, h = add_layernorm(x, block.mlp(h), None, after)
        return h

    def encode_early(
        self, crops: torch.Tensor, early_layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tower in its plain form: (final features, the residual stream after block
        ``early_layer``), the segment refiner's two inputs."""
        if not 0 <= early_layer < len(self.blocks):
            raise ValueError(f"early_layer {early_layer} outside the {len(self.blocks)} blocks")
        x = self.patch_emb(self.patchify(crops)) + self.pos_emb
        early = x
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == early_layer:
                early = x
        return self.post_ln(x), early

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's features [1 + h*w, patches, enc_dim] -> embeddings [patches, text_dim]."""
        g = self.cfg.grid_size
        h, w = tiling
        if features.shape[0] != 1 + h * w:
            raise ValueError(
                f"expected {1 + h * w} crops for tiling {tiling}, got {features.shape[0]}"
            )
        global_feat = features[0]
        local = features[1:].view(h * w, g, g, -1)
        stitched = stitch_tiles(local, (h, w), self.cfg.overlap_margin)
        pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g))
        pooled = pooled.permute(1, 2, 0).reshape(g * g, -1)
        return self.proj_mlp(torch.cat([global_feat, pooled], dim=-1))


def stitch_tiles(tiles: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Stitch overlapping tile grids [h*w, g, g, d] into [c*h + 2m, c*w + 2m, d], c = g - 2m.

    Each tile keeps its centre; tiles on an image edge also keep the margin on that edge.
    """
    h, w = tiling
    _, g, _, d = tiles.shape
    c = g - 2 * margin
    out = tiles.new_zeros(c * h + 2 * margin, c * w + 2 * margin, d)
    for ty in range(h):
        y0 = 0 if ty == 0 else margin
        y1 = g if ty == h - 1 else g - margin
        for tx in range(w):
            x0 = 0 if tx == 0 else margin
            x1 = g if tx == w - 1 else g - margin
            oy, ox = ty * c, tx * c
            out[oy + y0 : oy + y1, ox + x0 : ox + x1] = tiles[ty * w + tx, y0:y1, x0:x1]
    return out
