"""Moondream 2 as a model family: its presets, checkpoints, loader and random weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from vlm_server.models.common.memory_shape import memory_shape
from vlm_server.models.common.quant_load import QuantRequest
from vlm_server.models.interface import FamilyConfig, KVShape, LoadedModel, MemoryShape
from vlm_server.models.moondream2.config import FORMATS, PRESETS, ModelConfig
from vlm_server.models.moondream2.layout import expected_shapes
from vlm_server.models.moondream2.loader import (
    load_model,
    load_state,
    quant_targets,
    random_model,
    read_config,
    weights_file,
)
from vlm_server.models.moondream2.readable import make_readable
from vlm_server.models.moondream2.reference_config import is_moondream_format
from vlm_server.models.moondream2.writer import CONFIG_FORMAT, write_checkpoint
from vlm_server.models.quant.formats import QuantFormat


class Moondream2Family:
    """The registry's handle on Moondream 2 (every revision's token contract)."""

    name = "moondream2"
    formats = FORMATS

    @property
    def presets(self) -> Mapping[str, Callable[[], FamilyConfig]]:
        return PRESETS

    def owns(self, config: FamilyConfig) -> bool:
        return isinstance(config, ModelConfig)

    def reads(self, meta: Mapping[str, Any]) -> bool:
        if meta.get("format") == CONFIG_FORMAT:
            return meta.get("family", self.name) == self.name
        model_type = meta.get("model_type")
        hub_snapshot = isinstance(model_type, str) and model_type.startswith("moondream")
        return is_moondream_format(dict(meta)) or hub_snapshot

    def read_config(self, directory: Path, preset_name: str | None) -> FamilyConfig:
        return read_config(directory, preset_name)

    def memory_shape(self, config: FamilyConfig) -> MemoryShape:
        assert isinstance(config, ModelConfig)
        text, vision = config.text, config.vision
        return memory_shape(
            config,
            expected_shapes(config),
            KVShape(text.n_layers, text.n_kv_heads, text.head_dim),
            qkv_dim=(text.n_heads + 2 * text.n_kv_heads) * text.head_dim,
            ff_dim=text.ff_dim,
            enc_dim=vision.enc_dim,
            enc_ff_dim=vision.enc_ff_dim,
            proj_inner_dim=vision.proj_inner_dim,
            linears=quant_targets(config, vision=False),
            rotary_dim=text.rotary_dim,
            enc_layers=vision.enc_n_layers,
            # Stacking a block's products (models/common/fused_products.py) moves its four
            # weights into two stacks and adds one tensor: proj's and fc2's biases summed.
            fused_elements=text.n_layers * text.dim,
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
        vision_quant: QuantFormat | None = None,
    ) -> LoadedModel:
        return load_model(
            path,
            preset_name=preset_name,
            dtype=dtype,
            device=device,
            tokenizer_path=tokenizer_path,
            progress=progress,
            quant=quant,
            vision_quant=vision_quant,
        )

    def random_model(
        self,
        config: FamilyConfig,
        *,
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        progress: bool,
        quant: QuantRequest | None = None,
        vision_quant: QuantFormat | None = None,
    ) -> LoadedModel:
        assert isinstance(config, ModelConfig)
        return random_model(
            config,
            seed=seed,
            dtype=dtype,
            device=device,
            progress=progress,
            quant=quant,
            vision_quant=vision_quant,
        )

    def write_checkpoint(
        self, config: FamilyConfig, out_dir: Path, *, seed: int, progress: bool, **options: Any
    ) -> Path:
        assert isinstance(config, ModelConfig)
        # readable=True: answers in words and captions of real lengths (the built-in model).
        readable = options.pop("readable", False)
        out = write_checkpoint(config, out_dir, seed=seed, progress=progress, **options)
        if readable:
            make_readable(out, config, seed=seed)
        return out

    def expected_shapes(self, config: FamilyConfig) -> dict[str, tuple[int, ...]]:
        assert isinstance(config, ModelConfig)
        return expected_shapes(config)

    def quant_targets(self, config: FamilyConfig, vision: bool) -> list[str]:
        assert isinstance(config, ModelConfig)
        return quant_targets(config, vision)

    def read_state(
        self, path: Path, preset_name: str | None
    ) -> tuple[FamilyConfig, dict[str, torch.Tensor]]:
        directory = path if path.is_dir() else path.parent
        config = read_config(directory, preset_name)
        weights = weights_file(path) if path.is_dir() else path
        return config, load_state(weights, config, torch.bfloat16, "cpu", progress=False)


FAMILY = Moondream2Family()
