"""Partial rotary position embedding (NeoX half-split layout, fp32 math)."""

from __future__ import annotations

import torch


def rotary_tables(
    rotary_dim: int, max_positions: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim // 2] in fp32."""
    inv_freq = theta ** (
        -torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    )
    angles = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x [..., T, head_dim] by per-position angles.

    cos/sin are [..., T, rotary_dim // 2], already gathered at the tokens' positions. The
    rotated half is computed in fp32 and cast back; the remaining dims pass through. Moondream
    writes the rotated pair back interleaved, which permutes Q and K alike and so gives the same
    attention as this half-split form.
    """
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, x[..., 2 * half :]], dim=-1)
