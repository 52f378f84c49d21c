"""Tau scaling: per-head factors on queries and values from the projection and the position.

For each head j at absolute position p, with g = GELU(qkv) over the whole fused projection:
``tau_q[j] = tanh(wq[j] . g) + sigmoid(alpha[j] * ln(p + 1)) + 1/2`` (values alike with wv).
Keys are not scaled, so a cache holds keys after rotary and values after tau; the position term
depends on the absolute position only, so a cached image prefix stays valid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_server.models.moondream3 import tau_kernel
from vlm_server.models.moondream3.config import TauGelu, TauPositions, TextConfig


class Tau(nn.Module):
    """wq [H, qkv_dim], wv [KVH, qkv_dim] (no bias) and alpha [H]: checkpoint names."""

    def __init__(self, cfg: TextConfig, gelu: TauGelu, positions: TauPositions) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.zeros(cfg.n_heads, cfg.qkv_dim))
        self.wv = nn.Parameter(torch.zeros(cfg.n_kv_heads, cfg.qkv_dim))
        self.alpha = nn.Parameter(torch.zeros(cfg.n_heads))
        self.approximate = "tanh" if gelu == "tanh" else "none"
        self.positions = positions
        self.bf16_positions = positions == "bf16"
        # [wq; wv] in the activations' dtype for the two-launch kernels (tau_kernel.py), set by
        # `use_kernel`; None: the PyTorch ops.
        self._stacked: torch.Tensor | None = None

    def use_kernel(self, enabled: bool) -> bool:
        """Scale with the Triton kernels (CUDA) from now on, or not; returns
        whether it is on. Call it after loading the weights and before any graph capture."""
        on = enabled and tau_kernel.available(self.wq)
        self._stacked = torch.cat([self.wq, self.wv]).detach().contiguous() if on else None
        return on

    def _position_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype positions are cast to before the term (None: the fp32 choice)."""
        if self.positions == "activations":
            return dtype
        return torch.bfloat16 if self.bf16_positions else None

    def position_term(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``sigmoid(alpha * ln(p + 1)) + 1/2`` at positions [B, T] -> [B, T, H] in ``dtype``
        (exactly 1 at p = 0)."""
        cast = self._position_dtype(dtype)
        if cast is not None:
            # The Hugging Face code casts positions to the activations' dtype first: in bf16
            # they round above 256 (729 and 730 both become 728), and the rest runs in that
            # dtype too; in an fp32 run nothing rounds.
            p = positions.to(cast)
            s = torch.sigmoid(self.alpha.to(cast) * (p + 1).log()[..., None])
            return (1 + (s - 0.5)).to(dtype)
        lp = torch.log1p(positions.to(torch.float32))[..., None]
        return (torch.sigmoid(self.alpha.float() * lp) + 0.5).to(dtype)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Fused projection [B, T, qkv_dim] at positions [B, T] -> (tau_q [B, T, H],
        tau_v [B, T, KVH])."""
        g = F.gelu(qkv, approximate=self.approximate)
        pos = self.position_term(positions, qkv.dtype)
        tq = torch.tanh(F.linear(g, self.wq)) + pos
        tv = torch.tanh(F.linear(g, self.wv)) + pos[..., : self.wv.shape[0]]
        return tq, tv

    def scale(self, qkv: torch.Tensor, positions: torch.Tensor, n_heads: int) -> torch.Tensor:
        """The fused projection with its query and value heads scaled (keys untouched),
        still packed Q | K | V: what the cache's fused rotary + attention kernels take."""
        w = self._stacked
        cast = self._position_dtype(qkv.dtype)
        # The kernels compute the position term in fp32 or from bf16 positions; a cast to
        # another dtype (fp32 or fp16 activations under "activations") runs the PyTorch ops.
        kernel_positions = cast is None or cast == torch.bfloat16
        if w is not None and w.dtype == qkv.dtype and qkv.is_cuda and kernel_positions:
            return tau_kernel.tau_scale(
                qkv, positions, w, self.alpha, self.wq.shape[0], self.wv.shape[0],
                self.approximate == "none", cast == torch.bfloat16,
            )  # fmt: skip
        tq, tv = self(qkv, positions)
        b, t, width = qkv.shape
        hd = width // (n_heads + 2 * tv.shape[-1])
        q, k, v = qkv.split([n_heads * hd, tv.shape[-1] * hd, tv.shape[-1] * hd], dim=-1)
        q = (q.view(b, t, n_heads, hd) * tq[..., None]).view(b, t, -1)
        v = (v.view(b, t, -1, hd) * tv[..., None]).view(b, t, -1)
        return torch.cat([q, k, v], dim=-1)
