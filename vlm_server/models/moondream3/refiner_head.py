"""The segmentation refiner's head (the author's `moondream/SegHeadRefiner`, ``model.pt``'s
``"head"``): a SAM-decoder-like network that turns a coarse mask and the vision tower's
features of one crop into four mask hypotheses and their predicted IoU.

Inputs: the tower's final (post-LayerNorm) patch features and its residual stream after block
``early_layer`` (both [B, grid * grid, enc_dim]), and the current mask [B, 1, H, W] in [0, 1].
The parameter names are the checkpoint's (150 tensors, 6,147,460 parameters at the released
size, enc_dim 1152, grid 27, width 256), so ``load_state_dict`` takes the file as published.

- the final features, projected to the width, are fused with the early ones (projected,
  normed, GELU) by a 1x1 and a 3x3 convolution; the mask, encoded by four stride-2
  convolutions and resized to the grid, is added;
- 4 mask tokens and 1 IoU token run two two-way blocks against the image tokens (self
  attention, tokens to image, MLP x8, image to tokens; learned positional terms on both), then
  a last tokens-to-image attention;
- the image tokens are upsampled x8 (three transposed convolutions, each with a 3x3
  convolution); each mask token, projected to an eighth of the width and attended over the
  upsampled pixels, becomes one hypothesis through its own MLP (a dot product per pixel),
  resized to the mask's size; the IoU token's MLP predicts each hypothesis' IoU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_MASKS = 4


class ChannelNorm(nn.Module):
    """LayerNorm over the channels of [B, C, H, W]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _down(cin: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.GroupNorm(groups, cout), nn.GELU()
    )


class MaskEncoder(nn.Module):
    """[B, 1, H, W] -> [B, width, grid, grid]: four stride-2 convolutions, then a resize."""

    def __init__(self, width: int, grid: int) -> None:
        super().__init__()
        self.grid = grid
        c1, c2, c3 = width // 16, width // 8, width // 4
        self.conv1 = _down(1, c1, 1)
        self.conv2 = _down(c1, c2, min(8, c2))
        self.conv3 = _down(c2, c3, min(16, c3))
        self.conv4 = _down(c3, width, min(32, width))

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        x = self.conv4(self.conv3(self.conv2(self.conv1(mask))))
        return F.interpolate(x, size=(self.grid, self.grid), mode="bilinear", align_corners=False)


class FeatureFusion(nn.Module):
    """The early features (projected) beside the projected final ones -> [B, width, g, g]."""

    def __init__(self, enc_dim: int, width: int, grid: int) -> None:
        super().__init__()
        self.grid = grid
        self.early_proj = nn.Sequential(nn.Linear(enc_dim, width), nn.LayerNorm(width), nn.GELU())
        self.fusion = nn.Sequential(
            nn.Conv2d(2 * width, width, 1), nn.GroupNorm(32, width), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(32, width), nn.GELU(),
        )  # fmt: skip

    def forward(self, early: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        b = early.shape[0]
        e = self.early_proj(early).transpose(1, 2).reshape(b, -1, self.grid, self.grid)
        return self.fusion(torch.cat([e, final], dim=1))


def _attend(attn: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return attn(q, k, v, need_weights=False)[0]


class TwoWayBlock(nn.Module):
    """Tokens attend to themselves and to the image, an MLP, then the image to the tokens."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 8) -> None:
        super().__init__()
        self.output_self_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(width)
        self.cross_attn_token_to_image = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, width * mlp_ratio), nn.GELU(), nn.Linear(width * mlp_ratio, width)
        )
        self.norm3 = nn.LayerNorm(width)
        self.cross_attn_image_to_token = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm4 = nn.LayerNorm(width)

    def forward(
        self, tok: torch.Tensor, img: torch.Tensor, tok_pe: torch.Tensor, img_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = tok + tok_pe
        tok = self.norm1(tok + _attend(self.output_self_attn, q, q, tok))
        tok = self.norm2(
            tok + _attend(self.cross_attn_token_to_image, tok + tok_pe, img + img_pe, img)
        )
        tok = self.norm3(tok + self.mlp(tok))
        img = self.norm4(
            img + _attend(self.cross_attn_image_to_token, img + img_pe, tok + tok_pe, tok)
        )
        return tok, img


def _upsampler(width: int) -> nn.Sequential:
    """x8: three (transposed conv x2, norm, GELU, 3x3 conv, norm, GELU), halving channels."""
    layers: list[nn.Module] = []
    c = width
    for _ in range(3):
        layers += [nn.ConvTranspose2d(c, c // 2, 2, stride=2), ChannelNorm(c // 2), nn.GELU()]
        layers += [nn.Conv2d(c // 2, c // 2, 3, padding=1), ChannelNorm(c // 2), nn.GELU()]
        c //= 2
    return nn.Sequential(*layers)


def _mlp3(dim: int, out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, out)
    )


class RefinerHead(nn.Module):
    """(final [B, g*g, enc_dim], early [B, g*g, enc_dim], mask [B, 1, H, W]) ->
    (mask logits [B, 4, H, W], predicted IoU [B, 4])."""

    def __init__(
        self, enc_dim: int = 1152, grid: int = 27, width: int = 256, heads: int = 8,
        blocks: int = 2,
    ) -> None:  # fmt: skip
        super().__init__()
        self.enc_dim, self.grid, self.width = enc_dim, grid, width
        self.image_proj = nn.Conv2d(enc_dim, width, 1)
        self.image_pe = nn.Parameter(torch.zeros(1, width, grid, grid))
        self.hq_fusion = FeatureFusion(enc_dim, width, grid)
        self.mask_encoder = MaskEncoder(width, grid)
        self.mask_tokens = nn.Parameter(torch.zeros(NUM_MASKS, width))
        self.iou_token = nn.Parameter(torch.zeros(1, width))
        self.output_pe = nn.Parameter(torch.zeros(NUM_MASKS + 1, width))
        self.transformer_blocks = nn.ModuleList(TwoWayBlock(width, heads) for _ in range(blocks))
        self.final_token_to_image = nn.MultiheadAttention(width, heads, batch_first=True)
        self.final_norm = nn.LayerNorm(width)
        self.upsample = _upsampler(width)
        fine = width // 8
        self.final_q_proj = nn.Linear(width, fine)
        self.final_attn_up = nn.MultiheadAttention(fine, 4, batch_first=True)
        self.final_norm_up = nn.LayerNorm(fine)
        self.mask_mlps = nn.ModuleList(_mlp3(fine, fine) for _ in range(NUM_MASKS))
        self.iou_head = _mlp3(width, NUM_MASKS)

    def forward(
        self, final: torch.Tensor, early: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, g = final.shape[0], self.grid
        img = self.image_proj(final.reshape(b, g, g, self.enc_dim).permute(0, 3, 1, 2))
        img = self.hq_fusion(early, img) + self.mask_encoder(mask)
        img_tok = img.flatten(2).transpose(1, 2)
        img_pe = self.image_pe.flatten(2).transpose(1, 2).expand(b, -1, -1)
        tok = torch.cat([self.mask_tokens, self.iou_token])[None].expand(b, -1, -1)
        tok_pe = self.output_pe[None].expand(b, -1, -1)
        for block in self.transformer_blocks:
            tok, img_tok = block(tok, img_tok, tok_pe, img_pe)
        tok = self.final_norm(
            tok + _attend(self.final_token_to_image, tok + tok_pe, img_tok + img_pe, img_tok)
        )
        up = self.upsample(img_tok.transpose(1, 2).reshape(b, self.width, g, g))
        up_tok = up.flatten(2).transpose(1, 2)
        q = self.final_q_proj(tok[:, :NUM_MASKS])
        q = q + _attend(self.final_attn_up, self.final_norm_up(q), up_tok, up_tok)
        weights = torch.stack([mlp(q[:, i]) for i, mlp in enumerate(self.mask_mlps)], dim=1)
        logits = torch.einsum("bmc,bchw->bmhw", weights, up)
        logits = F.interpolate(logits, size=mask.shape[-2:], mode="bilinear", align_corners=False)
        return logits, self.iou_head(tok[:, NUM_MASKS])


def random_head(seed: int = 0, **sizes: int) -> RefinerHead:
    """A head with seeded random weights in the released layout (tests, benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    head = RefinerHead(**sizes)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name or p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return head.eval()
