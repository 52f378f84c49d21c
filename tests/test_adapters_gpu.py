"""GPU checks of finetune adapters (run on a CUDA machine; skipped elsewhere): the grouped
Triton LoRA kernels against the PyTorch path over random shapes and uneven adapter
assignment (one target, and the decoder's stacked shrink with two-output expands), their
determinism, under graph capture, and the CUDA engine (graphs, the side-stream slot copy)
against the reference."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from image_pipeline import PreparedImage, prepare_pil, sample_image
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import files
from vlm_server.models.lora.bank import masked_lora, segmented_lora
from vlm_server.models.lora.writer import write_random
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu


def _per_token(x, a, b, index):  # type: ignore[no-untyped-def]
    """The plain definition, token by token, in fp32."""
    out = torch.zeros(x.shape[0], b.shape[1], device=x.device)
    for t, s in enumerate(index.tolist()):
        if s >= 0:
            out[t] = (x[t].float() @ a[s].float().T) @ b[s].float().T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_grouped_lora_kernel_matches_torch(dtype: torch.dtype, seed: int) -> None:
    from vlm_server.models.common.lora_kernel import grouped_lora

    g = torch.Generator().manual_seed(seed)

    def pick(options: list[int]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    t, k, n = pick([1, 5, 64, 333]), pick([64, 200, 2048]), pick([96, 2048, 6144, 8192])
    slots, layers, r = pick([1, 3, 8]), 2, pick([4, 16, 32])
    # Stacked like the bank: [slots, layers, r, k] and [slots, layers, n, r]; one layer's view.
    a_all = (torch.randn(slots, layers, r, k, generator=g) * 0.1).to("cuda", dtype)
    b_all = (torch.randn(slots, layers, n, r, generator=g) * 0.1).to("cuda", dtype)
    a, b = a_all[:, 1], b_all[:, 1]
    # Uneven: most tokens on slot 0, a few on others, some on none (-1).
    weights = torch.tensor([0.2] + [0.6] + [0.2 / max(1, slots - 1)] * (slots - 1))
    index = torch.multinomial(weights, t, replacement=True, generator=g).to(torch.int32) - 1
    x = torch.randn(t, k, generator=g).to("cuda", dtype)
    idx = index.cuda()
    got = grouped_lora(x, a, b, idx).float()
    want = _per_token(x, a, b, idx)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Added into a layer's output in place: rows without an adapter keep theirs exactly.
    base = torch.randn(t, n, generator=g).to("cuda", dtype)
    out = grouped_lora(x, a, b, idx, out=base.clone())
    torch.testing.assert_close(out.float(), base.float() + want, atol=tol, rtol=tol)
    assert torch.equal(out[idx < 0], base[idx < 0])
    # The image prefixes' form: runs of one slot each, as batched products.
    runs = torch.tensor([1, -1, 0], dtype=torch.int32, device="cuda") % slots
    runs[1] = -1
    xs = torch.randn(3 * 7, k, generator=g).to("cuda", dtype)
    seg = segmented_lora(xs, a, b, runs, 7).float()
    torch.testing.assert_close(
        seg, _per_token(xs, a, b, runs.repeat_interleave(7)), atol=tol, rtol=tol
    )
    torch.testing.assert_close(masked_lora(x, a, b, idx).float(), want, atol=tol, rtol=tol)


def test_grouped_lora_kernel_replays_in_a_graph_with_new_slots_and_weights() -> None:
    from vlm_server.models.common.lora_kernel import grouped_lora

    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 16, 256, generator=g).cuda() * 0.1
    b = torch.randn(4, 512, 16, generator=g).cuda() * 0.1
    x = torch.randn(32, 256, generator=g).cuda()
    idx = torch.full((32,), -1, dtype=torch.int32, device="cuda")
    grouped_lora(x, a, b, idx)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_lora(x, a, b, idx)
    idx.copy_(torch.randint(-1, 4, (32,), generator=g).to(torch.int32))
    a[2].copy_(torch.randn(16, 256, generator=g) * 0.1)  # a slot refilled after capture
    graph.replay()
    torch.testing.assert_close(y, _per_token(x, a, b, idx), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_the_stacked_shrink_and_two_output_expand_match_torch(
    dtype: torch.dtype, seed: int
) -> None:
    """The decoder's fused form at moondream2-like widths: one shrink over three stacked
    targets, one expand into two outputs (the second through GELU), in place; rows without
    an adapter keep their output bit for bit (GELU'd on the second)."""
    from vlm_server.models.common import lora_kernel as lk

    g = torch.Generator().manual_seed(seed)
    t = [1, 32, 77, 256][seed]
    slots, r, k, n1, n2 = 8, 32, 2048, 6144, 8192
    a = (torch.randn(slots, 3 * r, k, generator=g) * 0.05).to("cuda", dtype)
    b1 = (torch.randn(slots, n1, r, generator=g) * 0.05).to("cuda", dtype)
    b2 = (torch.randn(slots, n2, r, generator=g) * 0.05).to("cuda", dtype)
    index = (torch.randint(0, slots + 1, (t,), generator=g).to(torch.int32) - 1).cuda()
    x = torch.randn(t, k, generator=g).to("cuda", dtype)
    base1 = torch.randn(t, n1, generator=g).to("cuda", dtype)
    base2 = torch.randn(t, n2, generator=g).to("cuda", dtype)
    y1, y2 = base1.clone(), base2.clone()
    parts = lk.shrink(x, a, index)
    lk.expand(index, lk.Target(parts, 0, b1, y1), lk.Target(parts, 2 * r, b2, y2), gelu=True)
    want1 = base1.float() + _per_token(x, a[:, :r], b1, index)
    want2 = F.gelu(base2.float() + _per_token(x, a[:, 2 * r :], b2, index), approximate="tanh")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y1.float(), want1, atol=tol, rtol=tol)
    torch.testing.assert_close(y2.float(), want2, atol=tol, rtol=tol)
    none = index < 0
    assert torch.equal(y1[none], base1[none])
    # Deterministic: the same launch again gives the same bits.
    again1, again2 = base1.clone(), base2.clone()
    parts = lk.shrink(x, a, index)
    lk.expand(index, lk.Target(parts, 0, b1, again1), lk.Target(parts, 2 * r, b2, again2), True)
    assert torch.equal(again1, y1) and torch.equal(again2, y2)


def test_a_tokens_delta_does_not_depend_on_the_batch() -> None:
    """Other tokens' inputs and slots change; the kept tokens' deltas stay bit for bit (both
    forms of the kernels)."""
    from vlm_server.models.common import lora_kernel as lk

    def grouped(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> object:
        y = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
        lk.expand(idx, lk.Target(lk.shrink(x, a, idx), 0, b, y))
        return y

    g = torch.Generator().manual_seed(5)
    t, k, n, slots, r = 64, 8192, 2048, 8, 32
    a = (torch.randn(slots, r, k, generator=g) * 0.05).to("cuda", torch.bfloat16)
    b = (torch.randn(slots, n, r, generator=g) * 0.05).to("cuda", torch.bfloat16)
    x = torch.randn(t, k, generator=g).to("cuda", torch.bfloat16)
    index = (torch.randint(0, slots + 1, (t,), generator=g).to(torch.int32) - 1).cuda()
    keep = (torch.arange(t) % 3 == 0).cuda()
    x2 = torch.where(keep[:, None], x, torch.randn_like(x))
    other = (torch.randint(0, slots + 1, (t,), generator=g).to(torch.int32) - 1).cuda()
    for form in (lk.grouped_lora, grouped):
        first = form(x, a, b, index)
        second = form(x2, a, b, torch.where(keep, index, other))
        assert torch.equal(first[keep], second[keep])


def test_the_fused_block_path_replays_in_a_graph() -> None:
    """A block's adapter calls as the decoder makes them (stacked shrink of qkv, proj and
    fc1; qkv and fc1 expanded with the GELU; proj beside fc2) captured in a CUDA graph: after
    new slots and a refilled slot, a replay equals an eager run."""
    from vlm_server.models.lora.bank import LoraBank, LoraBatch
    from vlm_server.models.lora.spec import LoraTargets
    from vlm_server.models.lora.writer import random_state

    d, f = 256, 1024
    targets = LoraTargets(
        2, {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, f), "fc2": (f, d)},
        shared=(("qkv", "proj", "fc1"),),
    )  # fmt: skip
    bank = LoraBank(targets, 3, 16, torch.bfloat16, "cuda")

    def fill(slot: int, seed: int) -> None:
        state = {files.rename(k): v for k, v in random_state(targets, 16, seed).items()}
        w = files.validate(state, targets, 16, "x")
        bank.write(slot, bank.staging(w), w.rank)
        torch.cuda.synchronize()  # the staging buffer is refilled next

    for slot in range(3):
        fill(slot, slot)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 24, d, generator=g).to("cuda", torch.bfloat16)
    outs = {n: torch.randn(1, 24, w, generator=g).to("cuda", torch.bfloat16)
            for n, (_, w) in targets.targets.items()}  # fmt: skip
    index = torch.randint(-1, 3, (24,), generator=g).to(torch.int32).cuda()
    work = {n: torch.empty_like(o) for n, o in outs.items()}

    def block() -> list[torch.Tensor]:
        for n, o in outs.items():
            work[n].copy_(o)
        lora = LoraBatch(bank, index)
        shared = lora.shrink(1, h, ("qkv", "proj", "fc1"))
        qkv, act = lora.expand(
            1, [(shared, "qkv", work["qkv"]), (shared, "fc1", work["fc1"])], gelu_last=True
        )
        hidden = lora.shrink(1, act, ("fc2",))
        proj, fc2 = lora.expand(1, [(shared, "proj", work["proj"]), (hidden, "fc2", work["fc2"])])
        return [qkv, act, proj, fc2]

    block()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block()
    index.copy_(torch.randint(-1, 3, (24,), generator=g).to(torch.int32))
    fill(2, 9)
    graph.replay()
    replayed = [y.clone() for y in captured]
    for got, want in zip(replayed, block(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fc2_shrink", ["expand", "branch", "apart"])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_the_fused_decode_forward_with_adapters_matches_the_four_products(
    tiny: LoadedModel, rows: int, fc2_shrink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows with two adapters and none through the stacked products (the shrinks riding
    the products, fc2's in the expand, the branch or apart; deltas added into the QKV + fc1
    product and into the branch's split sums) against the four-product forward with the same
    adapters (fp32: the two agree to rounding)."""
    from vlm_server.models.lora import products

    monkeypatch.setattr(products, "FC2_SHRINK", fc2_shrink)
    from vlm_server.engine.device.kernels.paged_attention import DecodeKV
    from vlm_server.models.lora.bank import LoraBank, LoraBatch
    from vlm_server.models.lora.writer import random_state

    model = copy.deepcopy(tiny.model).cuda()
    text = model.text
    cfg, targets = text.cfg, text.lora_targets
    bank = LoraBank(targets, 2, 8, torch.float32, "cuda")
    for slot in range(2):
        state = {files.rename(k): v for k, v in random_state(targets, 8, slot, 0.3).items()}
        w = files.validate(state, targets, 8, "x")
        bank.write(slot, bank.staging(w), w.rank)
        torch.cuda.synchronize()  # the staging buffer is refilled next
    page = 16
    g = torch.Generator(device="cuda").manual_seed(rows)
    shape = (rows * 4 + 1, page, cfg.n_kv_heads, cfg.head_dim)
    k0 = [torch.randn(shape, device="cuda", generator=g) for _ in range(cfg.n_layers)]
    v0 = [torch.randn(shape, device="cuda", generator=g) for _ in range(cfg.n_layers)]
    table = torch.arange(1, rows * 4 + 1, device="cuda", dtype=torch.int32).view(rows, 4)
    row_ids = torch.arange(rows, device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 4 * page, (rows, 1), device="cuda", generator=g)
    x = torch.randn(rows, 1, cfg.dim, device="cuda", generator=g)
    index = (torch.arange(rows, device="cuda") % 3 - 1).to(torch.int32)  # -1, 0, 1, ...

    def run() -> torch.Tensor:
        ks, vs = [k.clone() for k in k0], [v.clone() for v in v0]
        rope = (text.rope_cos, text.rope_sin)
        cache = DecodeKV(ks, vs, table, row_ids, 4, rope, cfg.n_heads, True)
        return text(x, positions, cache, LoraBatch(bank, index))

    with torch.no_grad():
        plain = run()
        assert text.use_fused_products(True)
        fused = run()
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


def test_cuda_engine_with_adapters_equals_the_reference(tiny: LoadedModel, tmp_path: Path) -> None:
    """fp32 on CUDA: graphs (decode, mixed, prefix) carry the adapter index; a mixed batch
    of no adapter and two adapters answers as the reference does for each alone."""
    model = copy.deepcopy(tiny.model).cuda()
    loaded = LoadedModel(model, tiny.tokenizer, tiny.config, tiny.source)
    targets = model.text.lora_targets
    for i, name in enumerate(["a", "b"]):
        write_random(tmp_path, name, targets, rank=8, seed=i, scale=0.3)
    base = sample_image()
    images: list[PreparedImage] = [
        prepare_pil(base),
        prepare_pil(base.rotate(90, expand=True)),
    ]
    names = [None, "a", "b", "a", None, "b"]
    reqs = [
        GenerationRequest(Task.CAPTION, images[i % 2], temperature=0, max_tokens=16, adapter=name)
        for i, name in enumerate(names)
    ]
    cfg = EngineConfig(
        max_batch_size=8, kv_budget_bytes=64 << 20, adapters_dir=str(tmp_path), max_adapter_rank=8
    )

    async def run() -> list[str]:
        engine = InProcessEngine(BatchedEngine(loaded, cfg))
        await engine.start()
        try:
            steps = engine.batched.runtime.steps
            assert steps.decode_graphs and steps.lora_decode_graphs and steps.lora_mixed_graphs

            async def one(req: GenerationRequest) -> str:
                async for event in await engine.submit(req):
                    if isinstance(event, Finished):
                        return event.text
                raise AssertionError("no result")

            return await asyncio.gather(*[one(r) for r in reqs])
        finally:
            await engine.close()

    texts = asyncio.run(run())
    settings = SamplingSettings(temperature=0, max_tokens=16)
    for req, text in zip(reqs, texts, strict=True):
        weights = None
        if req.adapter:
            path = files.find(tmp_path, req.adapter)
            weights = files.load(path, targets, 8, req.adapter)
        ref = ReferenceGenerator(model, tiny.tokenizer, weights)
        assert text == ref.caption(req.image, "normal", settings).text, req.adapter
