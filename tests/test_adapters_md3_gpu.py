"""GPU checks of Moondream 3 finetune adapters (run on a CUDA machine; skipped elsewhere): the
fused expert kernels with the adapters' deltas against the plain PyTorch path over random
shapes, slot assignments and ranks (bf16, fp32, FP8 experts), under graph capture with slots
and weights changed after it, and the CUDA engine (graphs with and without the deltas) against
the reference."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest
import torch

from image_pipeline import PreparedImage, prepare_pil, sample_image
from vlm_server.engine.api import Finished, GenerationRequest, Task
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.engine import BatchedEngine
from vlm_server.models.interface import LoadedModel
from vlm_server.models.lora import files, finetune_files, formats
from vlm_server.models.lora.experts import ExpertLoraBank
from vlm_server.models.lora.spec import ExpertTargets, LoraTargets
from vlm_server.models.lora.writer import random_finetune, write_random_finetune
from vlm_server.models.registry import preset, random_model
from vlm_server.reference import ReferenceGenerator, SamplingSettings
from vlm_server.server.in_process import InProcessEngine

pytestmark = pytest.mark.gpu

SHAPES = [  # tokens, top_k, experts, dim, expert width, adapter slots
    (1, 8, 64, 2048, 1024, 2),
    (7, 3, 8, 64, 32, 3),
    (64, 8, 64, 2048, 1024, 4),
    (300, 2, 16, 96, 48, 3),
    (801, 8, 64, 256, 128, 2),
]


def _targets(k: int, e: int, d: int, i: int) -> LoraTargets:
    experts = ExpertTargets(0, 1, e, k, {"fc1": (d, 2 * i), "fc2": (i, d)})
    return LoraTargets(0, {}, experts, format="finetune")


def _bank(targets: LoraTargets, slots: int, max_rank: int, dtype, device, seed: int):  # type: ignore[no-untyped-def]
    """A bank whose slots hold random finetunes of different ranks (the last one's lower)."""
    bank = ExpertLoraBank(targets, slots, max_rank, dtype, device)
    ex = targets.experts
    assert ex is not None
    k, scale = ex.top_k, 2 / ex.targets["fc1"][0] ** 0.5  # deltas of a tenth of the outputs
    for slot in range(slots):
        rank = max_rank if slot + 1 < slots else k * max(1, max_rank // k // 2)
        state = random_finetune(targets, rank, seed=seed + slot, scale=scale)["lora_state_dict"]
        w = finetune_files.validate(state, targets, max_rank, f"w{slot}")
        bank.write(slot, bank.staging(w), w.rank)
        if bank.device.type == "cuda":
            torch.cuda.synchronize()  # the staging buffer is reused by the next write
    return bank


def _case(n, k, e, d, i, slots, dtype, seed):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    w1 = torch.randn(e, 2 * i, d, generator=gen) / d**0.5
    w1[:, i:] *= 0.25
    w2 = torch.randn(e, d, i, generator=gen) / i**0.5
    index = torch.randint(-1, slots, (n,), generator=gen, dtype=torch.int32)  # -1: none
    return x, ids, w1, w2, index


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8"])
def test_fused_experts_with_adapters_equal_the_plain_path(shape: tuple[int, ...], dtype) -> None:  # type: ignore[no-untyped-def]
    from vlm_server.models.moondream3 import fp8_experts
    from vlm_server.models.moondream3.moe import experts_loop_lora
    from vlm_server.models.moondream3.moe_triton import experts_fused

    n, k, e, d, i, slots = shape
    fp8 = dtype == "fp8"
    if fp8 and not fp8_experts.fp8_experts_supported(torch.device("cuda")):
        pytest.skip("FP8 experts need compute capability 9.0")
    act = torch.bfloat16 if fp8 else dtype
    x, ids, w1, w2, index = _case(*shape, act, seed=sum(shape))
    targets = _targets(k, e, d, i)
    max_rank = 4 * k
    plain_bank = _bank(targets, slots, max_rank, torch.float32, "cpu", seed=n)
    bank = _bank(targets, slots, max_rank, act, "cuda", seed=n)
    s1 = s2 = None
    if fp8:  # the plain path reads the same weights, dequantized
        (q1, s1), (q2, s2) = fp8_experts.quantize(w1), fp8_experts.quantize(w2)
        w1 = fp8_experts.dequantize(q1, s1, torch.float32)
        w2 = fp8_experts.dequantize(q2, s2, torch.float32)
        g1, g2, s1, s2 = q1.cuda(), q2.cuda(), s1.cuda(), s2.cuda()
    else:
        g1, g2 = w1.to("cuda", act), w2.to("cuda", act)
    xc, idc, index_c = x.to("cuda", act), ids.cuda(), index.cuda()
    got = experts_fused(xc, idc, g1, g2, s1, s2, partial(bank.expert_delta, index_c, 0))
    want = experts_loop_lora(
        xc.float().cpu(), ids, w1.float(), w2.float(), partial(plain_bank.expert_delta, index, 0)
    )
    tol = 1e-4 if act == torch.float32 else 4e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
    # Tokens without an adapter: exactly the kernels' answer without one (their deltas are
    # exact zeros added to the same accumulators).
    base = experts_fused(xc, idc, g1, g2, s1, s2)
    none = index_c < 0
    assert torch.equal(got[none], base[none])
    if (~none).any():  # and the adapters change the others
        assert not torch.allclose(got[~none].float(), base[~none].float(), atol=tol)


def test_fused_experts_with_adapters_replay_in_a_graph_with_new_slots_and_weights() -> None:
    from vlm_server.models.moondream3.moe import experts_loop_lora
    from vlm_server.models.moondream3.moe_triton import experts_fused

    n, k, e, d, i, slots = 48, 8, 64, 256, 128, 3
    x, ids, w1, w2, index = _case(n, k, e, d, i, slots, torch.float32, seed=11)
    targets = _targets(k, e, d, i)
    bank = _bank(targets, slots, 16, torch.float32, "cuda", seed=1)
    xc, idc, g1, g2 = x.cuda(), ids.cuda(), w1.cuda(), w2.cuda()
    index_c = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    delta = partial(bank.expert_delta, index_c, 0)
    experts_fused(xc, idc, g1, g2, None, None, delta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = experts_fused(xc, idc, g1, g2, None, None, delta)
    # After capture: tokens take adapters, and slot 1 is refilled with another finetune.
    index_c.copy_(index.cuda())
    state = random_finetune(targets, 8, seed=99, scale=0.1)["lora_state_dict"]
    w = finetune_files.validate(state, targets, 16, "refill")
    bank.write(1, bank.staging(w), w.rank)
    torch.cuda.synchronize()
    graph.replay()
    plain = _bank(targets, slots, 16, torch.float32, "cpu", seed=1)
    plain.write(1, plain.staging(w), w.rank)
    want = experts_loop_lora(x, ids, w1, w2, partial(plain.expert_delta, index, 0))
    torch.testing.assert_close(y.cpu(), want, atol=1e-4, rtol=1e-4)


def test_cuda_engine_with_finetunes_equals_the_reference(tmp_path: Path) -> None:
    """fp32 on CUDA: decode, mixed and prefix graphs with and without the deltas; a mixed
    batch of no adapter and two finetunes answers as the reference does for each alone."""
    loaded: LoadedModel = random_model(
        preset("md3-tiny"), seed=1, dtype=torch.float32, device="cuda", progress=False
    )
    targets = loaded.model.text.lora_targets
    for j, (name, rank) in enumerate([("a@1", 6), ("b@2", 3)]):
        write_random_finetune(tmp_path, name, targets, rank=rank, seed=j, scale=0.4)
    base = sample_image()
    images: list[PreparedImage] = [prepare_pil(base), prepare_pil(base.rotate(90, expand=True))]
    names = [None, "a@1", "b@2", "a@1", None, "b@2"]
    reqs = [
        GenerationRequest(Task.CAPTION, images[j % 2], temperature=0, max_tokens=12, adapter=name)
        for j, name in enumerate(names)
    ]
    cfg = EngineConfig(
        max_batch_size=8, kv_budget_bytes=64 << 20, adapters_dir=str(tmp_path), max_adapter_rank=6
    )

    async def run() -> list[str]:
        engine = InProcessEngine(BatchedEngine(loaded, cfg))
        await engine.start()
        try:
            rt = engine.batched.runtime
            assert isinstance(rt.adapter_bank, ExpertLoraBank)
            assert rt.steps.decode_graphs and rt.steps.lora_decode_graphs
            assert rt.steps.lora_mixed_graphs and rt.prefill.lanes[0].lora_prefix_graphs

            async def one(req: GenerationRequest) -> str:
                async for event in await engine.submit(req):
                    if isinstance(event, Finished):
                        return event.text
                raise AssertionError("no result")

            return await asyncio.gather(*[one(r) for r in reqs])
        finally:
            await engine.close()

    texts = asyncio.run(run())
    settings = SamplingSettings(temperature=0, max_tokens=12)
    for req, text in zip(reqs, texts, strict=True):
        weights = None
        if req.adapter:
            path = files.find(tmp_path, req.adapter)
            weights = formats.load(path, targets, 6, req.adapter)
        ref = ReferenceGenerator(loaded.model, loaded.tokenizer, weights)
        assert text == ref.caption(req.image, "normal", settings).text, req.adapter
