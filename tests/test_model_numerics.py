"""One vision block, one text block and the region heads against plain float64 formulas."""

from __future__ import annotations

import math

import torch

from vlm_server.models.common.vision import VisionBlock, stitch_tiles
from vlm_server.models.interface import LoadedModel
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.moondream2.region import RegionModel
from vlm_server.models.moondream2.text import TextBlock
from vlm_server.models.registry import preset


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * w + b


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _lin(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return x @ layer.weight.double().T + layer.bias.double()


def _softmax_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def test_vision_block_matches_float64(tiny: LoadedModel) -> None:
    block: VisionBlock = tiny.model.vision.blocks[0]
    cfg = tiny.config.vision
    x = torch.randn(2, 50, cfg.enc_dim, generator=torch.Generator().manual_seed(0))
    got = block(x)
    xd = x.double()
    h = _ln(xd, block.ln1.weight.double(), block.ln1.bias.double())
    qkv = _lin(h, block.attn.qkv)
    d, nh = cfg.enc_dim, cfg.enc_n_heads
    q, k, v = (
        qkv[..., i * d : (i + 1) * d].reshape(2, 50, nh, d // nh).transpose(1, 2) for i in range(3)
    )
    a = _softmax_attn(q, k, v, None).transpose(1, 2).reshape(2, 50, d)
    xd = xd + _lin(a, block.attn.proj)
    h = _ln(xd, block.ln2.weight.double(), block.ln2.bias.double())
    want = xd + _lin(_gelu(_lin(h, block.mlp.fc1)), block.mlp.fc2)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_text_block_matches_float64_with_prefix_mask_and_partial_rotary(tiny: LoadedModel) -> None:
    cfg = tiny.config.text
    block: TextBlock = tiny.model.text.blocks[0]
    t, prefix = 12, 5
    x = torch.randn(1, t, cfg.dim, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(t)[None]
    cos, sin = tiny.model.text.rope_cos[pos], tiny.model.text.rope_sin[pos]
    kv = tiny.model.kv_shape
    cache = DenseKVCache(kv, cfg.max_context, 1, torch.float32, "cpu", prefix_len=prefix)
    got = block(x, cos, sin, pos, cache, 0)

    xd = x.double()
    h = _ln(xd, block.ln.weight.double(), block.ln.bias.double())
    qkv = _lin(h, block.attn.qkv)
    nh, hd, d = cfg.n_heads, cfg.head_dim, cfg.dim
    q, k, v = (
        qkv[..., i * d : (i + 1) * d].reshape(1, t, nh, hd).transpose(1, 2) for i in range(3)
    )
    # Moondream's own form: rotate the first rotary_dim dims with (re, im) = halves, then
    # write back interleaved; the interleave permutes q and k alike.
    r = cfg.rotary_dim
    inv = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv

    def rope(z: torch.Tensor) -> torch.Tensor:
        re, im = z[..., : r // 2], z[..., r // 2 : r]
        c, s = ang.cos(), ang.sin()
        out = torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2)
        return torch.cat([out, z[..., r:]], -1)

    qi, ki = rope(q), rope(k)
    i = torch.arange(t)
    allowed = (i[None, :] <= i[:, None]) | ((i[:, None] < prefix) & (i[None, :] < prefix))
    a = _softmax_attn(qi, ki, v, allowed).transpose(1, 2).reshape(1, t, d)
    want = xd + _lin(a, block.attn.proj) + _lin(_gelu(_lin(h, block.mlp.fc1)), block.mlp.fc2)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # The prefix really is bidirectional: position 0 depends on position 4, not on 5.
    assert allowed[0, 4] and not allowed[0, 5] and allowed[7, 6] and not allowed[6, 7]


def test_region_heads_match_float64(tiny: LoadedModel) -> None:
    region: RegionModel = tiny.model.region
    hidden = torch.randn(3, tiny.config.text.dim, generator=torch.Generator().manual_seed(2))
    x = torch.tensor([[0.0], [0.25], [0.999]])
    wh = torch.tensor([[0.1, 0.5], [1.0, 0.01], [0.3, 0.3]])

    def fourier(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        f = 2 * math.pi * v.double() @ w.double()
        return torch.cat([f.cos(), f.sin()], -1)

    torch.testing.assert_close(
        region.encode_coord(x).double(),
        _lin(fourier(x, region.coord_features), region.coord_encoder),
        atol=1e-4,
        rtol=1e-4,
    )
    torch.testing.assert_close(
        region.encode_size(wh).double(),
        _lin(fourier(wh, region.size_features), region.size_encoder),
        atol=1e-4,
        rtol=1e-4,
    )
    hd = hidden.double()
    for mlp, got in (
        (region.coord_decoder, region.decode_coord(hidden)),
        (region.size_decoder, region.decode_size(hidden)),
    ):
        want = _lin(_gelu(_lin(hd, mlp.fc1)), mlp.fc2)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert region.decode_coord(hidden).shape[-1] == 1024
    assert region.decode_size(hidden).shape[-1] == 2048


def test_patchify_order_matches_conv_weight_flattening(tiny: LoadedModel) -> None:
    enc = tiny.model.vision
    cfg = tiny.config.vision
    crops = torch.randn(1, 3, cfg.crop_size, cfg.crop_size)
    patches = enc.patchify(crops)
    p = cfg.patch_size
    py, px = 3, 5
    want = crops[0, :, py * p : (py + 1) * p, px * p : (px + 1) * p].reshape(-1)
    assert torch.equal(patches[0, py * cfg.grid_size + px], want)


def test_stitching_places_tiles_with_margins() -> None:
    g, m = 27, 4
    tiles = torch.arange(6, dtype=torch.float32).view(6, 1, 1, 1).expand(6, g, g, 1).clone()
    out = stitch_tiles(tiles, (2, 3), m)
    c = g - 2 * m
    assert out.shape == (2 * c + 2 * m, 3 * c + 2 * m, 1)
    assert out[0, 0, 0] == 0 and out[-1, -1, 0] == 5
    assert out[c + m, c + m, 0] == 4  # row 1, column 1 -> tile 1*3 + 1
    assert out[c + m - 1, c + m - 1, 0] == 0  # last row/column that tile 0 keeps


def test_project_pools_to_the_grid_and_puts_global_first(tiny: LoadedModel) -> None:
    enc = tiny.model.vision
    cfg = preset("tiny").vision
    feats = torch.randn(1 + 2 * 4, cfg.n_patches, cfg.enc_dim)
    out = enc.project(feats, (2, 4))
    assert out.shape == (cfg.n_patches, cfg.proj_out_dim)
    # 1x1 tiling: pooling is the identity, so the local half equals crop 1's features.
    feats1 = torch.randn(2, cfg.n_patches, cfg.enc_dim)
    inner = torch.cat([feats1[0], feats1[1]], -1)
    torch.testing.assert_close(enc.project(feats1, (1, 1)), enc.proj_mlp(inner))
