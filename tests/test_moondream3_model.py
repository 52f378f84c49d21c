"""Moondream 3's decoder against the invariants its formulas imply (docs/moondream3.md):
top-k routing and the expert formula, uneven expert loads, tau scaling, the image prefix seen
both ways, region heads and the disputed-point choices."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from decoding.region_values import coord_from_logits
from vlm_server.models import registry
from vlm_server.models.kv import DenseKVCache
from vlm_server.models.moondream3.config import (
    CONTRACT_MD3,
    CONTRACT_MD3_TINY,
    HF_CHOICES,
    DisputedPoints,
    ModelConfig,
    MoeConfig,
    with_choices,
)
from vlm_server.models.moondream3.model import Moondream3Model
from vlm_server.models.moondream3.moe import (
    MoeMLP,
    combine_slots,
    expert_activation,
    experts_dense,
    experts_loop,
    route,
)


def _tiny() -> ModelConfig:
    return registry.preset("md3-tiny")  # type: ignore[return-value]


def _model(config: ModelConfig | None = None, seed: int = 0) -> Moondream3Model:
    loaded = registry.random_model(
        config or _tiny(), seed=seed, dtype=torch.float32, progress=False
    )
    return loaded.model  # type: ignore[return-value]


def _moe(seed: int = 0, n_experts: int = 6, top_k: int = 3) -> MoeMLP:
    torch.manual_seed(seed)
    moe = MoeMLP(16, MoeConfig(start_layer=0, n_experts=n_experts, top_k=top_k, expert_dim=8))
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    return moe.requires_grad_(False)


def _naive_moe(moe: MoeMLP, x: torch.Tensor) -> torch.Tensor:
    """The formula of docs/moondream3.md, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = moe.router(x[n])
        top = sorted(range(logits.shape[0]), key=lambda e: -float(logits[e]))[: moe.top_k]
        weights = torch.softmax(logits[top], dim=0)
        for w, e in zip(weights, top, strict=True):
            z = moe.fc1.weight[e] @ x[n]
            a, b = z[: z.shape[0] // 2], z[z.shape[0] // 2 :]
            out[n] += w * (moe.fc2.weight[e] @ (F.gelu(a) * (b + 1)))
    return out


# ---- routing and experts --------------------------------------------------------------------


def test_routing_takes_the_top_k_raw_logits_and_softmaxes_only_those() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    weights, ids = route(logits, 3)
    assert ids.tolist() == [[1, 4, 3], [0, 1, 2]]
    want = torch.softmax(torch.tensor([3.0, 2.5, 2.0]), dim=0)
    assert torch.allclose(weights[0], want)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    half = route(logits.to(torch.bfloat16), 3)[0]
    assert half.dtype == torch.bfloat16  # computed in fp32, returned in the activations' dtype


@pytest.mark.parametrize("method", ["loop", "dense"])
def test_the_moe_layer_equals_the_formula_token_by_token(method: str) -> None:
    moe = _moe()
    moe.method = method  # type: ignore[assignment]
    x = torch.randn(2, 7, 16)
    got = moe(x)
    assert torch.allclose(got.view(-1, 16), _naive_moe(moe, x.view(-1, 16)), atol=1e-5)


def test_uneven_expert_loads_give_the_same_outputs_either_way() -> None:
    moe = _moe(seed=1, n_experts=8, top_k=2)
    x = torch.randn(33, 16)
    # Most tokens to experts 0 and 5, a few to 3 and 6, none to the rest.
    ids = torch.tensor([[0, 5]] * 29 + [[3, 6], [6, 3], [5, 0], [3, 0]])
    w1, w2 = moe.fc1.weight, moe.fc2.weight
    loop, dense = experts_loop(x, ids, w1, w2), experts_dense(x, ids, w1, w2)
    assert torch.allclose(loop, dense, atol=1e-5)
    assert torch.allclose(loop[31, 1], F.linear(expert_activation(w1[0] @ x[31]), w2[0]))
    one = experts_loop(x[:1], torch.tensor([[7, 7]]), w1, w2)  # a lone token, one expert
    assert torch.allclose(one[0, 0], one[0, 1])


def test_identical_experts_make_the_output_independent_of_the_router() -> None:
    moe = _moe(seed=2)
    moe.fc1.weight.data[:] = moe.fc1.weight.data[0]
    moe.fc2.weight.data[:] = moe.fc2.weight.data[0]
    x = torch.randn(5, 16)
    before = moe(x)
    moe.router.weight.data.normal_(0, 3.0)
    assert torch.allclose(moe(x), before, atol=1e-5)


def test_a_zero_plus_one_half_leaves_exactly_the_erf_gelu() -> None:
    z = torch.cat([torch.randn(4, 8), torch.zeros(4, 8)], dim=-1)
    assert torch.equal(expert_activation(z), F.gelu(z[:, :8]))
    assert not torch.equal(expert_activation(z), F.gelu(z[:, :8], approximate="tanh"))


def test_combine_weights_the_slots() -> None:
    y = torch.randn(3, 2, 4)
    w = torch.tensor([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]])
    assert torch.allclose(combine_slots(y, w), (y * w[..., None]).sum(1))


# ---- tau --------------------------------------------------------------------------------


def test_tau_position_term_is_one_at_position_zero_and_everywhere_when_alpha_is_zero() -> None:
    tau = _model().text.blocks[0].attn.tau
    pos = torch.tensor([[0, 1, 729, 4000]])
    term = tau.position_term(pos, torch.float32)
    assert torch.equal(term[0, 0], torch.ones(4))
    alpha = tau.alpha.float()
    want = torch.sigmoid(alpha * math.log(730)) + 0.5
    assert torch.allclose(term[0, 2], want)
    tau.alpha.data.zero_()
    assert torch.equal(tau.position_term(pos, torch.float32), torch.ones(1, 4, 4))


def test_bf16_tau_positions_round_like_the_hf_code() -> None:
    model = _model(with_choices(_tiny(), DisputedPoints(tau_positions="bf16")))
    tau = model.text.blocks[0].attn.tau
    tau.alpha.data.fill_(0.7)
    term = tau.position_term(torch.tensor([[729, 730]]), torch.float32)
    assert torch.equal(term[0, 0], term[0, 1])  # both positions round to 728 in bf16
    fp32 = _model().text.blocks[0].attn.tau
    fp32.alpha.data.fill_(0.7)
    term = fp32.position_term(torch.tensor([[729, 730]]), torch.float32)
    assert not torch.equal(term[0, 0], term[0, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_dtype_positions_follow_the_run_as_the_hf_code_does(
    dtype: torch.dtype,
) -> None:
    """`HF_CHOICES` casts positions to the activations' dtype: bf16 rounding in a bf16 run,
    none in an fp32 run (where the term is the published code's fp32 arithmetic)."""
    assert HF_CHOICES.tau_positions == "activations"
    tau = _model(with_choices(_tiny(), HF_CHOICES)).text.blocks[0].attn.tau
    tau.alpha.data.fill_(0.7)
    pos = torch.tensor([[0, 5, 729, 730, 3001]])
    got = tau.position_term(pos, dtype)
    p = pos.to(dtype)
    want = (1 + (torch.sigmoid(tau.alpha.to(dtype) * (p + 1).log()[..., None]) - 0.5)).to(dtype)
    assert torch.equal(got, want)
    if dtype != torch.float16:  # fp16's term rounds both alike whatever the positions
        assert torch.equal(got[0, 2], got[0, 3]) is (dtype == torch.bfloat16)
    bf16 = _model(with_choices(_tiny(), DisputedPoints(tau_positions="bf16")))
    bf16_tau = bf16.text.blocks[0].attn.tau
    bf16_tau.alpha.data.fill_(0.7)
    if dtype == torch.bfloat16:
        assert torch.equal(got, bf16_tau.position_term(pos, dtype))
    with pytest.raises(ValueError):
        DisputedPoints(tau_positions="fp16")  # type: ignore[arg-type]


def test_zero_tau_weights_and_alpha_give_plain_attention_and_keys_never_change() -> None:
    model = _model()
    attn = model.text.blocks[0].attn
    x = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    qkv = attn.qkv(x)
    scaled = attn.tau.scale(qkv, pos, 4)
    assert torch.equal(scaled[..., 64:128], qkv[..., 64:128])  # keys untouched
    assert not torch.allclose(scaled[..., :64], qkv[..., :64])
    for p in (attn.tau.wq, attn.tau.wv, attn.tau.alpha):
        p.data.zero_()
    assert torch.equal(attn.tau.scale(qkv, pos, 4), qkv)


def test_the_tau_gelu_choice_changes_the_scales() -> None:
    tanh = _model().text.blocks[1].attn
    erf = _model(with_choices(_tiny(), DisputedPoints(tau_gelu="erf"))).text.blocks[1].attn
    qkv = torch.randn(1, 3, tanh.cfg.qkv_dim)
    pos = torch.arange(3)[None]
    assert not torch.allclose(tanh.tau(qkv, pos)[0], erf.tau(qkv, pos)[0])


# ---- the decoder ----------------------------------------------------------------------------


class _PackedDense(DenseKVCache):
    """A cache that takes the packed projection, as the engine's CUDA caches do."""

    def __init__(self, model: Moondream3Model, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.model = model

    def attend_packed(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from vlm_server.models.common.rotary import apply_rotary

        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        cos = self.model.text.rope_cos[positions][:, None]
        sin = self.model.text.rope_sin[positions][:, None]
        return self.attend(
            layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, positions
        )


def _run(model: Moondream3Model, x: torch.Tensor, prefix: int, packed: bool = False):
    args = (model.kv_shape, 64, 1, torch.float32, "cpu", prefix)
    cache = _PackedDense(model, *args) if packed else DenseKVCache(*args)
    return model.text(x, torch.arange(x.shape[1])[None], cache)


def test_the_packed_path_the_cuda_kernels_take_equals_the_plain_one() -> None:
    model = _model()
    x = torch.randn(1, 12, 64)
    assert torch.allclose(_run(model, x, 5), _run(model, x, 5, packed=True), atol=1e-5)


def test_the_image_prefix_sees_itself_both_ways_and_text_never_reaches_back() -> None:
    model = _model()
    prefix = 6
    # A seeded input (the global generator's state depends on the tests that ran before)
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(5))
    base = _run(model, x, prefix)
    text_changed = x.clone()
    text_changed[0, 8] += 1.0
    assert torch.equal(_run(model, text_changed, prefix)[0, :prefix], base[0, :prefix])
    last_image = x.clone()
    last_image[0, prefix - 1] += 1.0
    # The random tiny model moves position 1 by ~1e-6 here (within allclose's tolerance):
    # any changed bit shows it sees the last image token, as the unchanged prefix above shows
    # text does not reach back.
    assert not torch.equal(_run(model, last_image, prefix)[0, 1], base[0, 1])


def test_layers_before_start_layer_are_dense_and_the_rest_experts() -> None:
    blocks = _model().text.blocks
    assert [type(b.mlp).__name__ for b in blocks] == ["MLP", "MLP", "MoeMLP", "MoeMLP"]


# ---- region heads and choices ------------------------------------------------------------------


def test_coordinate_bins_decode_by_the_configured_divisor() -> None:
    logits = torch.zeros(1, 1024)
    logits[0, 1023] = 1.0
    assert _tiny().tokens.coord_divisor == 1023
    assert float(coord_from_logits(logits, 1023)) == 1.0
    assert float(coord_from_logits(logits, 1024)) == pytest.approx(0.99902, abs=1e-5)
    assert with_choices(_tiny(), HF_CHOICES).tokens.coord_divisor == 1024
    with pytest.raises(ValueError, match="coord_divisor"):
        ModelConfig(name="x", tokens=_tiny().tokens, choices=HF_CHOICES)


def test_region_norm_choices_read_the_raw_or_the_final_normed_state() -> None:
    raw = _model()
    hidden = torch.randn(2, 64)
    ln = raw.region.ln
    assert torch.allclose(raw.region.decode_coord(hidden), raw.region.coord_decoder(ln(hidden)))
    post = _model(with_choices(_tiny(), DisputedPoints(region_norm="post_ln")))
    want = post.region.size_decoder(post.region.ln(post.text.post_ln(hidden)))
    assert torch.allclose(post.region.decode_size(hidden), want)
    none = _model(with_choices(_tiny(), DisputedPoints(region_norm="none")))
    assert not hasattr(none.region, "ln")
    assert torch.allclose(none.region.decode_coord(hidden), none.region.coord_decoder(hidden))
    assert "region.ln.weight" not in none.state_dict()


def test_hf_choices_and_context_are_one_call() -> None:
    config = with_choices(_tiny(), HF_CHOICES, max_context=4096)
    assert config.text.max_context == 4096 and config.choices.tau_gelu == "erf"
    assert registry.preset("moondream3.1").text.max_context == 32768  # type: ignore[attr-defined]
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_the_config_survives_json_with_its_tuples() -> None:
    """Written as JSON (a checkpoint's config.json) and read back, every tuple is a tuple
    again, the reasoning suppression included; an older file without the boundary rule
    reads as the family's rule."""
    for config in (_tiny(), registry.preset("moondream3.1")):
        data = json.loads(json.dumps(config.to_dict()))
        back = ModelConfig.from_dict(data)
        assert back == config
        assert isinstance(back.tokens.reasoning_suppressed_ids, tuple)
        del data["tokens"]["object_boundary"]
        assert ModelConfig.from_dict(data).tokens.object_boundary == "coord_or_eos"


def test_the_tiny_contract_speaks_the_full_contracts_rules() -> None:
    """md3-tiny differs from Moondream 3 only in its ids: the same suppression (the answer
    marker while answering, eos and size while reasoning) and boundary rule."""
    full, tiny = CONTRACT_MD3, CONTRACT_MD3_TINY
    for c in (full, tiny):
        assert c.decode_suppressed_ids == (c.answer_id,)
        assert c.reasoning_suppressed == (c.eos_id, c.size_id)
        assert c.object_boundary == "coord_or_eos"
    assert (full.coord_divisor, full.segment_language) == (
        tiny.coord_divisor,
        tiny.segment_language,
    )
    assert full.templates.reasoning_suffix == (full.thinking_id,)
    assert tiny.templates.reasoning_suffix == (tiny.thinking_id,)


# ---- the fused path's grouping and FP8 experts ---------------------------------------------


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_pairs_by_expert_in_whole_blocks(block_m: int) -> None:
    from vlm_server.models.moondream3.moe_routing import align

    gen = torch.Generator().manual_seed(block_m)
    ids = torch.randint(0, 8, (37, 3), generator=gen)
    ids[:20] = torch.tensor([1, 4, 6])  # uneven loads; some experts get nothing
    pair_ids, block_expert, used = align(ids, 8, block_m)
    flat = ids.reshape(-1)
    n_pairs = flat.numel()
    rows = pair_ids[: int(used)]
    assert sorted(r for r in rows.tolist() if r < n_pairs) == list(range(n_pairs))
    assert (pair_ids[int(used) :] == n_pairs).all()
    for b in range(int(used) // block_m):
        block = rows[b * block_m : (b + 1) * block_m]
        real = block[block < n_pairs].long()
        assert len(real) and (flat[real] == block_expert[b]).all()
    counts = torch.bincount(flat, minlength=8)
    assert int(used) == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_fp8_experts_run_dequantized_on_the_plain_paths() -> None:
    moe = _moe(seed=4)
    x = torch.randn(9, 16)
    moe.fc1.use_fp8()
    moe.fc2.use_fp8()
    assert moe.fc1.weight.dtype == torch.float8_e4m3fn and moe.fc1.scale.shape == (6, 16)
    w1, w2 = moe.fc1.values(torch.float32), moe.fc2.values(torch.float32)
    weights, ids = route(moe.router(x), moe.top_k)
    want = combine_slots(experts_loop(x, ids, w1, w2), weights)
    for method in ("loop", "dense"):
        moe.method = method  # type: ignore[assignment]
        assert torch.allclose(moe(x), want, atol=1e-5)


def test_the_tile_table_fits_small_shared_memories_by_dropping_stages() -> None:
    """The table's tiles are the H100's; on a chip with 99 KiB per program (RTX 4090, L40,
    RTX 50) fewer pipeline stages make each fit, bf16 or FP8 weights; on the H100 nothing
    changes."""
    from vlm_server.models.moondream3.moe_triton import SMEM_MARGIN, TILES, fitted

    def smem(t: object, bm: int, w: int, halves: int) -> int:
        return t.stages * (bm * t.bk * 2 + halves * t.bk * t.bn * w)  # type: ignore[attr-defined]

    for _, tiles in TILES:
        for w_bytes in (1, 2):
            for t, halves in ((tiles.up, 2), (tiles.down, 1)):
                big = fitted(t, tiles.bm, 2, w_bytes, halves, 227 << 10)
                assert big == t
                small = fitted(t, tiles.bm, 2, w_bytes, halves, 99 << 10)
                assert small.stages >= 1 and (small.bn, small.bk) == (t.bn, t.bk)
                assert smem(small, tiles.bm, w_bytes, halves) <= SMEM_MARGIN * (99 << 10)
    prefill = TILES[-1][1]
    assert fitted(prefill.up, prefill.bm, 2, 2, 2, 99 << 10).stages < prefill.up.stages
