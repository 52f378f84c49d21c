"""The engine's memory plan (engine/core/memory_plan.py): exact numbers of the tiny presets,
agreement with the model the family builds (its weights, and the tensors made at start before
the KV pool), with the KV pool the engine sizes and the rule it sizes it by, and `vlm plan`
(text, JSON, a card that cannot hold the batch)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import pytest
import torch

from vlm_server.chips import CHIPS, by_name
from vlm_server.cli import main
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import (
    CPU_KV_BUDGET,
    KV_SHARE_OF_FREE,
    WEIGHT_FORMATS,
    kv_pages,
    plan_memory,
    planned_vision_fp8,
    start_tensors,
)
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.prefix_cache import PrefixCache
from vlm_server.engine.device import kv_pool
from vlm_server.engine.device.kv_pool import KVPool
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import TorchDevice
from vlm_server.models.common import fused_products
from vlm_server.models.common.fp8_vision import Fp8Tower
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream3 import tau_kernel
from vlm_server.models.registry import memory_shape, preset, random_model, write_checkpoint

GIB = 1 << 30


def test_the_tiny_plan_follows_from_its_config() -> None:
    # tiny: 2 layers, 4 KV heads of 16, prefix 1 + 27 * 27 = 730 positions.
    shape = memory_shape(preset("tiny"))
    cfg = EngineConfig(max_batch_size=8, kv_budget_bytes=8192 * 1000)
    plan = plan_memory(shape, cfg, 24 * GIB)
    assert plan.page_bytes == 2 * 2 * 16 * 4 * 16 * 2 == 8192
    assert plan.kv_pages == 1000
    assert plan.prefix_pages == 46  # 45 full pages and a tail of 10 positions
    # 730 + 64 + 768 positions: 98 pages, 45 of them the prefix's shared ones, plus the
    # prefix's own 46.
    assert plan.request_pages == 98 - 45 + 46 == 99
    assert plan.request_own_pages == 53
    assert plan.prefixes_held == 999 // 46
    assert plan.requests_held == 999 // 99 == 10
    assert plan.requests_held_one_picture == (999 - 46) // 53
    assert plan.fits
    # Beside the weights: rotary tables of 2048 positions of 8 / 2 (fp32), and the fused
    # decode's summed biases of 64 a layer (bf16).
    assert plan.held_at_kv_sizing == plan.weight_bytes + 2 * 2048 * 4 * 4 + 2 * 64 * 2
    assert plan.peak_bytes == plan.held_at_kv_sizing + 1000 * 8192 + plan.workspace_bytes


@pytest.mark.parametrize("name", ["tiny", "md3-tiny"])
def test_parameters_by_part_are_the_built_models(name: str) -> None:
    model = random_model(preset(name), dtype=torch.float32, progress=False).model
    assert isinstance(model, torch.nn.Module)
    built: dict[str, int] = {}
    for key, p in model.named_parameters():
        part = key.split(".")[0]
        part = "experts" if part == "text" and p.dim() == 3 else part
        built[part] = built.get(part, 0) + p.numel()
    shape = memory_shape(preset(name))
    assert shape.params == built
    plan = plan_memory(shape, EngineConfig(), 24 * GIB, "fp32")
    assert plan.weight_bytes == 4 * sum(built.values())


def test_fp8_experts_hold_a_byte_per_weight_and_a_scale_per_row() -> None:
    shape = memory_shape(preset("md3-tiny"))
    bf16 = plan_memory(shape, EngineConfig(), 24 * GIB, "bf16").weights
    fp8 = plan_memory(shape, EngineConfig(), 24 * GIB, "fp8-experts").weights
    assert fp8["experts"] == shape.params["experts"] + 4 * shape.expert_rows
    assert bf16["experts"] == 2 * shape.params["experts"]
    assert {k: v for k, v in fp8.items() if k != "experts"} == {
        k: v for k, v in bf16.items() if k != "experts"
    }
    # Two expert layers of eight experts: fc1 writes 2 x 32 rows, fc2 64.
    assert shape.expert_rows == 2 * 8 * (64 + 64)


def test_the_default_budget_is_a_share_of_what_the_start_leaves() -> None:
    shape = memory_shape(preset("moondream2"))
    cfg = EngineConfig(gpu_memory_bytes=8 * GIB)
    plan = plan_memory(shape, cfg, 80 * GIB)
    assert plan.limit_bytes == 8 * GIB
    # Held when the pool is sized: the weights, both rotary tables (fp32, 2048 positions of
    # 32 / 2) and the fused decode's summed biases (bf16, one of 2048 per layer, 24 layers).
    start = {"rotary tables": 2 * 2048 * 16 * 4, "fused decode stacks": 24 * 2048 * 2}
    assert plan.start_tensors == start
    held = plan.weight_bytes + sum(start.values())
    assert plan.held_at_kv_sizing == held
    assert plan.kv_budget_bytes == int((8 * GIB - held) * KV_SHARE_OF_FREE)
    assert plan.kv_pages == plan.kv_budget_bytes // plan.page_bytes
    assert plan.peak_bytes == held + plan.kv_bytes + plan.workspace_bytes
    # Moondream 2 in bf16: 1.93 billion parameters.
    assert 1.92e9 < plan.weight_bytes / 2 < 1.94e9
    # Uncapped, the card less the context and what is held.
    card = plan_memory(shape, EngineConfig(), 80 * GIB)
    assert card.kv_budget_bytes == int((80 * GIB - (512 << 20) - held) * KV_SHARE_OF_FREE)
    # Moondream 3 stacks each layer's tau weights, [wq; wv] of 32 + 32 rows of 6144, and
    # keeps rotary tables of 32768 positions; without fused decode it stacks none.
    md3 = memory_shape(preset("moondream3"))
    assert plan_memory(md3, cfg, 80 * GIB).start_tensors == {
        "rotary tables": 2 * 32768 * 16 * 4,
        "fused decode stacks": 24 * 64 * 6144 * 2,
    }
    plain = dataclasses.replace(cfg, fused_decode=False)
    assert plan_memory(md3, plain, 80 * GIB).start_tensors == {"rotary tables": 2 * 32768 * 16 * 4}


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views count once)."""
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def test_rotary_tables_are_the_built_models() -> None:
    for name in ("tiny", "md3-tiny"):
        model = random_model(preset(name), dtype=torch.float32, progress=False).model
        plan = plan_memory(memory_shape(preset(name)), EngineConfig(), 0, "fp32", cuda=False)
        tables = _storage_bytes([model.text.rope_cos, model.text.rope_sin])
        assert plan.start_tensors == {"rotary tables": tables}


def test_the_fused_decode_stacks_add_what_the_plan_counts(monkeypatch) -> None:
    """Stacking on the CPU as the runtime does on CUDA (ModelEntryPoints.use_fused_decode):
    what the model holds afterwards, less its weights before, is the plan's term."""
    # Moondream 2: each block's four products into two stacks, plus the summed biases.
    model = random_model(preset("tiny"), dtype=torch.float32, progress=False).model
    before = _storage_bytes(model.parameters())
    stacks = [
        fused_products.stack_block(b.attn.qkv, b.mlp.fc1, b.attn.proj, b.mlp.fc2)
        for b in model.text.blocks
    ]
    derived = [t for p in stacks for t in (p.w_in, p.b_in, p.w_out, p.b_out)]
    after = _storage_bytes([*model.parameters(), *derived])
    plan = plan_memory(memory_shape(preset("tiny")), EngineConfig(), 24 * GIB, "fp32")
    assert after - before == plan.start_tensors["fused decode stacks"] > 0
    # Moondream 3: the tau kernels' stacks (CPU: the kernels' availability stands in).
    monkeypatch.setattr(tau_kernel, "available", lambda x: True)
    model = random_model(preset("md3-tiny"), dtype=torch.float32, progress=False).model
    before = _storage_bytes(model.parameters())
    assert model.text.use_fused_products(True)
    derived = [b.attn.tau._stacked for b in model.text.blocks]
    after = _storage_bytes([*model.parameters(), *derived])
    plan = plan_memory(memory_shape(preset("md3-tiny")), EngineConfig(), 24 * GIB, "fp32")
    assert after - before == plan.start_tensors["fused decode stacks"] > 0


def test_the_fp8_vision_copies_are_the_towers() -> None:
    # An MLP width of 130 pads fc2's inputs to 256.
    base = preset("tiny")
    config = dataclasses.replace(base, vision=dataclasses.replace(base.vision, enc_ff_dim=130))
    model = random_model(config, dtype=torch.bfloat16, progress=False).model
    tower = Fp8Tower(model.vision)
    held = _storage_bytes(
        t
        for block in tower.blocks
        for w in (block.qkv, block.fc1, block.fc2)
        for t in (w.weight, w.scale, w.bias, w.one)
    )
    cfg = EngineConfig(vision_fp8=True)
    plan = plan_memory(memory_shape(config), cfg, 24 * GIB)
    assert plan.start_tensors["FP8 vision weights"] == held
    assert (
        "FP8 vision weights"
        not in plan_memory(memory_shape(config), EngineConfig(), GIB).start_tensors
    )


def test_the_engine_budgets_what_it_measures_by_the_plans_rule(monkeypatch) -> None:
    """On CUDA the pool gives the allocator's unused cache back first, then measures: live
    tensors' bytes are held, what the allocator still caches counts as free."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 6 * GIB)
    cuda = torch.device("cuda")
    kv_pool.release_cache(cuda)
    assert calls == ["empty"]
    assert kv_pool.default_budget(cuda) == int(12 * GIB * KV_SHARE_OF_FREE)
    assert kv_pool.default_budget(cuda, 8 * GIB) == int(4 * GIB * KV_SHARE_OF_FREE)
    # The plan's numbers under the same rule give the same budget.
    shape = memory_shape(preset("moondream2"))
    plan = plan_memory(shape, EngineConfig(gpu_memory_bytes=8 * GIB), 80 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: plan.held_at_kv_sizing)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: plan.held_at_kv_sizing)
    assert kv_pool.default_budget(cuda, 8 * GIB) == plan.kv_budget_bytes


def test_the_pool_gives_the_cache_back_before_it_measures(monkeypatch, tiny: LoadedModel) -> None:
    order: list[str] = []
    monkeypatch.setattr(kv_pool, "release_cache", lambda d: order.append("release"))

    def budget(device: torch.device, cap: int | None = None) -> int:
        order.append("measure")
        return CPU_KV_BUDGET

    monkeypatch.setattr(kv_pool, "default_budget", budget)
    KVPool(TorchDevice(torch.device("cpu")), ModelEntryPoints(tiny.model), EngineConfig())
    assert order == ["release", "measure"]


def test_the_engine_sizes_its_pool_and_reserve_as_the_plan_does(tiny: LoadedModel) -> None:
    entry = ModelEntryPoints(tiny.model)
    shape = memory_shape(tiny.config)
    configs = (
        EngineConfig(),
        EngineConfig(kv_budget_bytes=3 << 20, page_size=32),
        EngineConfig(kv_budget_bytes=3 << 20, kv_dtype="int8"),
        EngineConfig(kv_dtype="fp8", page_size=32),
    )
    for cfg in configs:
        pool = KVPool(TorchDevice(torch.device("cpu")), entry, cfg)
        plan = plan_memory(shape, cfg, 0, "fp32", cuda=False)
        assert pool.n_pages == plan.kv_pages
        assert plan.kv_budget_bytes == (cfg.kv_budget_bytes or CPU_KV_BUDGET)
        assert entry.kv_page_bytes(cfg.page_size, cfg.kv_dtype) == plan.page_bytes
        held = pool.kv.nbytes + (0 if pool.kv_scales is None else pool.kv_scales.nbytes)
        assert held == plan.kv_pages * plan.page_bytes  # the pages the plan counts, scales too
        alloc = PageAllocator(plan.kv_pages, cfg.page_size, 1, 200)
        cache = PrefixCache(alloc, tiny.config.image_prefix_len)
        assert cache.pages_per_entry == plan.prefix_pages
    assert kv_pages(10, 8192) == 2  # the sink and one page, whatever the budget


def test_compact_kv_pages_are_planned_with_their_scales(capsys: pytest.CaptureFixture[str]) -> None:
    """fp8 and int8: one byte an element plus a 4-byte scale per position and KV head, for
    keys and values: moondream2 (24 layers, 32 KV heads of 64) 3,145,728 bytes a page of 16
    in bf16, 1,671,168 compact (53%); fp8 needs an FP8 chip, int8 does not."""
    shape = memory_shape(preset("moondream2"))
    bf16 = plan_memory(shape, EngineConfig(), 80 * GIB)
    fp8 = plan_memory(shape, EngineConfig(kv_dtype="fp8"), 80 * GIB)
    assert (bf16.page_bytes, fp8.page_bytes) == (3_145_728, 2 * 24 * 16 * 32 * (64 + 4))
    assert fp8.kv_format == "fp8" and fp8.kv_pages == fp8.kv_budget_bytes // fp8.page_bytes
    assert main(["plan", "--gpu", "H100", "--kv-dtype", "fp8"]) in (0, 1)
    assert "(fp8, 1671168 bytes each)" in capsys.readouterr().out
    assert main(["plan", "--gpu", "A100 80GB", "--kv-dtype", "fp8"]) == 2
    assert "kv_dtype: fp8 needs compute capability 8.9" in capsys.readouterr().err
    assert main(["plan", "--gpu", "A100 80GB", "--kv-dtype", "int8"]) in (0, 1)


def test_cards_are_found_by_loose_names() -> None:
    assert by_name("nvidia geforce rtx-3090") is next(c for c in CHIPS if c.name == "RTX 3090")
    assert by_name("h100").memory_bytes > 79 * GIB
    with pytest.raises(ValueError, match="gpu: unknown card"):
        by_name("RTX 9999")


def test_vlm_plan_prints_the_plan_and_its_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu", "H100", "--model", "md2", "--max-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    labels = ("weights: text", "weights: vision", "rotary tables", "fused decode stacks")
    for label in (*labels, "KV pages", "graphs: image prefix", "left"):
        assert label in out
    assert "fits: 64 concurrent picture requests" in out


def test_a_card_too_small_refuses_with_the_bytes_needed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--gpu", "RTX 3090", "--model", "md3", "--max-batch-size", "64", "--json"]
    assert main(argv) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["requests_held"] < 64
    assert plan["kv_needed_bytes"] == (64 * plan["request_pages"] + 1) * plan["page_bytes"]
    assert plan["needed_bytes"] > plan["card_bytes"]
    # No FP8 experts on a 3090 (compute capability 8.6); larger cards hold the batch.
    assert "fp8-experts" not in plan["alternatives"]["formats"]
    assert "H100" in plan["alternatives"]["cards"]
    assert main(argv[:-1]) == 1
    out = capsys.readouterr().out
    assert "does not fit: 64 concurrent picture requests need" in out
    assert f"{plan['kv_needed_bytes']} bytes" in out


def test_vlm_plan_reads_a_checkpoints_config_and_refuses_bad_input(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = dataclasses.replace(preset("tiny"), name="tiny-small")
    folder = write_checkpoint(config, tmp_path / "ckpt", progress=False)
    (folder / "model.safetensors").write_bytes(b"not read")  # the weights are never opened
    assert main(["plan", "--gpu", "L4", "--model", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-small"
    assert main(["plan", "--gpu", "L4", "--model", "nothing-here"]) == 2
    assert "model: 'nothing-here'" in capsys.readouterr().err
    assert main(["plan", "--gpu", "L4", "--model", "md2", "--weights", "fp8-experts"]) == 2
    assert "weights: fp8-experts needs a mixture-of-experts" in capsys.readouterr().err
    assert main(["plan", "--gpu", "L4", "--weights", "fp16", "--kv-dtype", "bf16"]) == 2
    assert "kv_dtype" in capsys.readouterr().err


def test_the_plan_counts_the_fp8_tower_where_auto_turns_it_on() -> None:
    """auto (None) plans the FP8 copies for an FP8 build with an exact tower, as the runtime
    decides there (chips that hold FP8 experts have FP8 units); not for a 16-bit build or a
    quantized tower; on and off as asked."""
    config = preset("tiny")
    shape = memory_shape(config)
    fp8, bf16 = WEIGHT_FORMATS["fp8-experts"], WEIGHT_FORMATS["bf16"]
    auto = EngineConfig(vision_fp8=None)
    assert planned_vision_fp8(auto, fp8) and not planned_vision_fp8(auto, bf16)
    assert not planned_vision_fp8(EngineConfig(vision_fp8=None, vision_weights="int8"), fp8)
    assert planned_vision_fp8(EngineConfig(vision_fp8=True), bf16)
    assert not planned_vision_fp8(EngineConfig(vision_fp8=False), fp8)
    assert "FP8 vision weights" in start_tensors(shape, auto, fp8, cuda=True)
    assert "FP8 vision weights" not in start_tensors(shape, auto, bf16, cuda=True)
    assert "FP8 vision weights" not in start_tensors(shape, auto, fp8, cuda=False)
