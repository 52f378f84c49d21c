"""``--weights`` at start: ``auto`` resolved by the memory plan for this card (the decision
is engine/core/weights_choice.py's), and any format checked to hold the model under the cap,
before a byte of weights is read. One start-up line says which format and the bytes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from vlm_server.chip_features import fp8_supported
from vlm_server.default_model import default_model_dir
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.core.weights_choice import AUTO, choose_weights
from vlm_server.models.capabilities import served_weights
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common import quant_gemm
from vlm_server.models.hub import resolve_source
from vlm_server.models.interface import FamilyConfig
from vlm_server.models.quant.files import stored_format
from vlm_server.models.registry import checkpoint_config, family_of, memory_shape

log = logging.getLogger(__name__)

# Formats whose CUDA products are Triton kernels.
_TRITON_FORMATS = ("int8", "int4", "fp8")


def start_weights(
    source: str | None,
    preset_name: str | None,
    asked: str,
    cfg: EngineConfig,
    device: torch.device,
) -> str | None:
    """The ``weights`` to load ``source`` (None: the built-in model) with, for ``asked``
    (``--weights``); None: the checkpoint's own. On CUDA the choice is logged, and a format
    that cannot hold the model under ``cfg``'s cap raises `WeightsError` (a ValueError)."""
    path = resolve_source(source or default_model_dir())
    directory = path if path.is_dir() else path.parent
    stored = stored_format(path)
    if stored is not None and asked in (AUTO, stored.name):
        asked, own = stored.name, True  # served as written, never re-quantized
    else:
        own = False
    if device.type != "cuda":
        # No card to fit: the checkpoint's own values, unless a format is asked.
        return None if asked == AUTO or own else asked
    config = checkpoint_config(directory, preset_name)
    served = [stored.name] if own and stored is not None else _served(config, device)
    card = torch.cuda.get_device_properties(device).total_memory
    values = "fp8" if not own and stores_fp8(path) else None
    choice = choose_weights(memory_shape(config), cfg, card, asked, served, own=values)
    log.info(choice.line)
    return None if own else choice.weights


def stores_fp8(path: Path) -> bool:
    """Whether the checkpoint's safetensors hold FP8 values (Moondream 3's FP8 experts), from
    the files' headers alone."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for file in files:
        if file.suffix != ".safetensors":
            continue
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read the header of {file}: {err}") from err
        if any(
            isinstance(v, dict) and str(v.get("dtype", "")).startswith("F8_")
            for v in header.values()
        ):
            return True
    return False


def _served(config: FamilyConfig, device: torch.device) -> list[str]:
    """The formats ``config``'s family is served in on ``device``."""
    out = []
    for name in served_weights(family_of(config).formats):
        if name in _TRITON_FORMATS and not quant_gemm.AVAILABLE:
            continue
        if name == "fp8" and not fp8_supported(device):
            continue
        out.append(name)
    return out


__all__ = ["start_weights", "stores_fp8"]
