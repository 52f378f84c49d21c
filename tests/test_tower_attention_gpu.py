"""The vision tower's Triton attention on the GPU, in bf16: against exact attention over
random shapes (whole and partial blocks, with and without a tail slice, every launch shape the
tower probe sweeps), inside a captured graph, and the whole tower against the tower on SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.tower_probe import TRITON_ATTENTION_SHAPES
from vlm_server.models.common import tower_attention as ta
from vlm_server.models.moondream2.config import VisionConfig
from vlm_server.models.moondream2.vision import VisionEncoder

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not (torch.cuda.is_available() and ta.AVAILABLE):
        pytest.skip("needs CUDA and Triton")


def _exact(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    n, t, d3 = qkv.shape
    q, k, v = (c.float().view(n, t, heads, -1).transpose(1, 2) for c in qkv.chunk(3, -1))
    w = torch.softmax((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
    return (w @ v).transpose(1, 2).reshape(n, t, d3 // 3)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max())


@pytest.mark.parametrize(
    ("crops", "t", "heads", "hd"),
    [
        (9, 729, 16, 72),
        (1, 1, 16, 72),
        (2, 64, 3, 72),
        (3, 65, 2, 72),
        (2, 130, 4, 64),
        (1, 77, 2, 40),
    ],
)
def test_it_matches_exact_attention_as_closely_as_sdpa(
    crops: int, t: int, heads: int, hd: int
) -> None:
    g = torch.Generator(device="cuda").manual_seed(t)
    qkv = torch.randn(crops, t, 3 * heads * hd, device="cuda", generator=g).bfloat16() * 2
    want = _exact(qkv, heads)
    got = ta.tower_attention(qkv, heads)
    assert ta.uses_triton(qkv) and got.shape == want.shape
    sdpa = ta.tower_attention_sdpa(qkv, heads)
    # bf16 output rounding bounds both; the kernel's error may not exceed SDPA's by much
    assert _err(got, want) <= max(2 * _err(sdpa, want), 1e-2)


@pytest.mark.parametrize("shape", TRITON_ATTENTION_SHAPES)
def test_every_swept_launch_shape_is_right(shape: tuple[int, int, int, int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(2, 203, 3 * 4 * 72, device="cuda", generator=g).bfloat16()
    got = ta.tower_attention_triton(qkv, 4, ta.TowerAttentionConfig(*shape))
    assert _err(got, _exact(qkv, 4)) < 2e-2


def test_a_captured_graph_replays_it_on_new_inputs() -> None:
    qkv = torch.randn(3, 729, 3 * 1152, device="cuda").bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ta.tower_attention(qkv, 16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.tower_attention(qkv, 16)
    qkv.copy_(torch.randn_like(qkv))
    graph.replay()
    torch.testing.assert_close(out, ta.tower_attention(qkv, 16), atol=0, rtol=0)


@torch.inference_mode()
def test_the_tower_on_it_matches_the_tower_on_sdpa() -> None:
    torch.manual_seed(0)
    enc = VisionEncoder(VisionConfig()).to("cuda", torch.bfloat16).eval()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.02)
    crops = torch.randn(5, 3, 378, 378, device="cuda").bfloat16()
    got = enc.encode(crops).float()
    with ta.backend("sdpa"):
        want = enc.encode(crops).float()
    cos = F.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    assert float((got - want).norm() / want.norm()) < 1e-2
    assert float(cos.min()) > 0.999
