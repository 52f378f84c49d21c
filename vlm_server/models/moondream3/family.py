"""Moondream 3 as a model family: its presets, checkpoints (both layouts), loader and random
weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vlm_server.models.common.memory_shape import memory_shape
from vlm_server.models.common.quant_load import QuantRequest
from vlm_server.models.interface import FamilyConfig, KVShape, LoadedModel, MemoryShape
from vlm_server.models.moondream3.config import FORMATS, PRESETS, ModelConfig
from vlm_server.models.moondream3.layout import expected_shapes
from vlm_server.models.moondream3.loader import (
    dense_targets,
    load_model,
    load_state,
    random_model,
    read_config,
    weight_files,
)
from vlm_server.models.moondream3.model import Moondream3Model
from vlm_server.models.moondream3.writer import CONFIG_FORMAT, write_checkpoint
from vlm_server.models.moondream3.writer import FAMILY as FAMILY_NAME
from vlm_server.models.quant.formats import QuantFormat
from vlm_server.models.quant.targets import block_linears


def _is_hub_config(meta: Mapping[str, Any]) -> bool:
    """A Moondream 3 snapshot's own config.json: its model type, or an expert section in a
    nested or top-level ``text`` config (the structure is not established: both are seen)."""
    model_type = str(meta.get("model_type", ""))
    if model_type.startswith("moondream3"):
        return True
    inner = meta.get("config", meta)
    text = inner.get("text") if isinstance(inner, Mapping) else None
    return isinstance(text, Mapping) and "moe" in text


_LAYOUT_ALIASES = {"native": "hf", "legacy": "md3"}


def _tower_in(loaded: LoadedModel, fmt: QuantFormat | None) -> LoadedModel:
    """``loaded`` with its vision tower's linears quantized to ``fmt`` (None: as loaded)."""
    if fmt is not None:
        assert isinstance(loaded.model, Moondream3Model)
        loaded.model.quantize_vision(fmt)
    return loaded


class Moondream3Family:
    """The registry's handle on Moondream 3 (3-preview, 3.1 and the tiny test model)."""

    name = FAMILY_NAME
    formats = FORMATS

    @property
    def presets(self) -> Mapping[str, Callable[[], FamilyConfig]]:
        return PRESETS

    def owns(self, config: FamilyConfig) -> bool:
        return isinstance(config, ModelConfig)

    def reads(self, meta: Mapping[str, Any]) -> bool:
        if meta.get("format") == CONFIG_FORMAT:
            return meta.get("family") == self.name
        return _is_hub_config(meta)

    def read_config(self, directory: Path, preset_name: str | None) -> FamilyConfig:
        return read_config(directory, preset_name)

    def memory_shape(self, config: FamilyConfig) -> MemoryShape:
        assert isinstance(config, ModelConfig)
        text, vision = config.text, config.vision
        return memory_shape(
            config,
            expected_shapes(config),
            KVShape(text.n_layers, text.n_kv_heads, text.head_dim),
            qkv_dim=text.qkv_dim,
            ff_dim=max(text.ff_dim, 2 * text.moe.expert_dim),
            enc_dim=vision.enc_dim,
            enc_ff_dim=vision.enc_ff_dim,
            proj_inner_dim=vision.proj_inner_dim,
            linears=dense_targets(config),
            rotary_dim=text.rotary_dim,
            enc_layers=vision.enc_n_layers,
            top_k=text.moe.top_k,
            expert_dim=text.moe.expert_dim,
            # The tau kernels read each block's [wq; wv] stacked, a copy beside the weights
            # (tau.py `use_kernel`).
            fused_elements=text.n_layers * (text.n_heads + text.n_kv_heads) * text.qkv_dim,
        )

    def load(
        self,
        path: Path,
        *,
        preset_name: str | None,
        dtype: torch.dtype,
        device: torch.device | str,
        tokenizer_path: str | Path | None,
        progress: bool,
        quant: QuantRequest | None = None,
        experts_fp8: bool = False,
        vision_quant: QuantFormat | None = None,
    ) -> LoadedModel:
        loaded = load_model(
            path,
            preset_name=preset_name,
            dtype=dtype,
            device=device,
            tokenizer_path=tokenizer_path,
            quant=quant,
            experts_fp8=experts_fp8,
        )
        return _tower_in(loaded, vision_quant)

    def random_model(
        self,
        config: FamilyConfig,
        *,
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        progress: bool,
        quant: QuantRequest | None = None,
        experts_fp8: bool = False,
        vision_quant: QuantFormat | None = None,
    ) -> LoadedModel:
        assert isinstance(config, ModelConfig)
        loaded = random_model(
            config, seed=seed, dtype=dtype, device=device, quant=quant, experts_fp8=experts_fp8
        )
        return _tower_in(loaded, vision_quant)

    def write_checkpoint(
        self, config: FamilyConfig, out_dir: Path, *, seed: int, progress: bool, **options: Any
    ) -> Path:
        """``options``: ``layout`` ("hf" or "md3"), ``dtype``, ``shards``, ``fuse_tau``,
        ``file_format`` ("safetensors" or "pt"); see writer.py. The command line's layout
        names mean the same here: ``native`` is the HF layout (the model's own names),
        ``legacy`` the md3 one (the training layout's names)."""
        assert isinstance(config, ModelConfig)
        layout = options.pop("layout", "hf")
        options["layout"] = _LAYOUT_ALIASES.get(layout, layout)
        return write_checkpoint(config, out_dir, seed=seed, progress=progress, **options)

    def expected_shapes(self, config: FamilyConfig) -> dict[str, tuple[int, ...]]:
        assert isinstance(config, ModelConfig)
        return expected_shapes(config)

    def quant_targets(self, config: FamilyConfig, vision: bool) -> list[str]:
        assert isinstance(config, ModelConfig)
        return block_linears(expected_shapes(config), vision)

    def read_state(
        self, path: Path, preset_name: str | None
    ) -> tuple[FamilyConfig, dict[str, torch.Tensor]]:
        directory = path if path.is_dir() else path.parent
        config = read_config(directory, preset_name)
        state, _ = load_state(weight_files(path), config, torch.bfloat16, "cpu")
        return config, state


FAMILY = Moondream3Family()
