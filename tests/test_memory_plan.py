"""The engine's memory plan (engine/core/memory_plan.py): exact numbers of the tiny presets,
agreement with the model the family builds and with the KV pool the engine sizes, and
`vlm plan` (text, JSON, a card that cannot hold the batch)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vlm_server.chips import CHIPS, by_name
from vlm_server.cli import main
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.memory_plan import (
    CPU_KV_BUDGET,
    KV_SHARE_OF_FREE,
    kv_pages,
    plan_memory,
)
from vlm_server.engine.core.pages import PageAllocator
from vlm_server.engine.core.prefix_cache import PrefixCache
from vlm_server.engine.device.kv_pool import KVPool
from vlm_server.engine.device.model_entry import ModelEntryPoints
from vlm_server.engine.device.streams import TorchDevice
from vlm_server.models.interface import LoadedModel
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
    assert plan.peak_bytes == plan.weight_bytes + 1000 * 8192 + plan.workspace_bytes


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


def test_the_default_budget_is_a_share_of_what_the_weights_leave() -> None:
    shape = memory_shape(preset("moondream2"))
    cfg = EngineConfig(gpu_memory_bytes=8 * GIB)
    plan = plan_memory(shape, cfg, 80 * GIB)
    assert plan.limit_bytes == 8 * GIB
    assert plan.kv_budget_bytes == int((8 * GIB - plan.weight_bytes) * KV_SHARE_OF_FREE)
    assert plan.kv_pages == plan.kv_budget_bytes // plan.page_bytes
    # Moondream 2 in bf16: 1.93 billion parameters.
    assert 1.92e9 < plan.weight_bytes / 2 < 1.94e9


def test_the_engine_sizes_its_pool_and_reserve_as_the_plan_does(tiny: LoadedModel) -> None:
    entry = ModelEntryPoints(tiny.model)
    shape = memory_shape(tiny.config)
    for cfg in (EngineConfig(), EngineConfig(kv_budget_bytes=3 << 20, page_size=32)):
        pool = KVPool(TorchDevice(torch.device("cpu")), entry, cfg)
        plan = plan_memory(shape, cfg, 0, "fp32", cuda=False)
        assert pool.n_pages == plan.kv_pages
        assert plan.kv_budget_bytes == (cfg.kv_budget_bytes or CPU_KV_BUDGET)
        assert entry.kv_page_bytes(cfg.page_size) == plan.page_bytes
        alloc = PageAllocator(plan.kv_pages, cfg.page_size, 1, 200)
        cache = PrefixCache(alloc, tiny.config.image_prefix_len)
        assert cache.pages_per_entry == plan.prefix_pages
    assert kv_pages(10, 8192) == 2  # the sink and one page, whatever the budget


def test_cards_are_found_by_loose_names() -> None:
    assert by_name("nvidia geforce rtx-3090") is next(c for c in CHIPS if c.name == "RTX 3090")
    assert by_name("h100").memory_bytes > 79 * GIB
    with pytest.raises(ValueError, match="gpu: unknown card"):
        by_name("RTX 9999")


def test_vlm_plan_prints_the_plan_and_its_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu", "H100", "--model", "md2", "--max-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    for label in ("weights: text", "weights: vision", "KV pages", "graphs: image prefix", "left"):
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
