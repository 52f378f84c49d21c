"""Load a moondream2 checkpoint (native or legacy layout) into a `MoondreamModel`.

Accepted sources: a directory (``model.safetensors`` + ``tokenizer.json`` + ``config.json``),
a single ``.safetensors`` or ``.pt`` file, or a Hugging Face repo id (see `hub`). Shapes are
checked from the file header before any tensor is read, and every problem is reported at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from vlm_server.models.checkpoint_io import CheckpointError, CheckpointReader, check_shapes
from vlm_server.models.common.legacy_layout import legacy_to_native
from vlm_server.models.common.quant_load import QuantRequest, install, quantized_state
from vlm_server.models.common.random_weights import random_tensor
from vlm_server.models.common.tokenizer_build import build_tokenizer
from vlm_server.models.hub import resolve_source
from vlm_server.models.interface import LoadedModel
from vlm_server.models.moondream2.config import ModelConfig, preset
from vlm_server.models.moondream2.layout import (
    NATIVE_PREFIX,
    TRANSPOSED_NATIVE_KEYS,
    expected_shapes,
    is_native,
)
from vlm_server.models.moondream2.model import MoondreamModel
from vlm_server.models.moondream2.reference_config import from_moondream_dict, is_moondream_format
from vlm_server.models.moondream2.writer import (
    CONFIG_FILE,
    CONFIG_FORMAT,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
)
from vlm_server.models.quant.formats import QuantFormat
from vlm_server.models.quant.targets import block_linears

_PROGRESS_BYTES = 256 << 20  # show a progress bar for files larger than this


def read_config(directory: Path, preset_name: str | None) -> ModelConfig:
    """Config of a checkpoint directory: the project's own config.json, one in the moondream
    reference's format (`text` / `vision` / `region` / `tokenizer` sections), or a preset for
    a Hugging Face moondream snapshot (whose config.json carries no usable fields)."""
    path = directory / CONFIG_FILE
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from err
        if not isinstance(data, dict):
            raise CheckpointError(f"{path} does not hold a JSON object")
        if is_moondream_format(data):
            return from_moondream_dict(data, preset_name)
        if data.get("format") == CONFIG_FORMAT:
            config = ModelConfig.from_dict(data["model"])
            if preset_name is not None and preset(preset_name) != config:
                raise CheckpointError(
                    f"{path} describes model {config.name!r}, which differs "
                    f"from the requested preset {preset_name!r}"
                )
            return config
        if data.get("model_type", "").startswith("moondream"):
            return preset(preset_name or "moondream2")
    if preset_name is None:
        raise CheckpointError(
            f"{directory} has no usable {CONFIG_FILE}; name a preset "
            "(e.g. moondream2 or moondream2-2025-01-09)"
        )
    return preset(preset_name)


def weights_file(directory: Path) -> Path:
    for name in (WEIGHTS_FILE, "model.pt"):
        if (directory / name).exists():
            return directory / name
    found = sorted(directory.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    raise CheckpointError(
        f"{directory} holds no {WEIGHTS_FILE}"
        + (f" (and several .safetensors: {[f.name for f in found]})" if found else "")
    )


def _native_names(keys: list[str]) -> tuple[dict[str, str], list[str], bool]:
    """Map file keys to native names; return (native -> file key, unknown keys, legacy?)."""
    ignored = (".kv_cache.k_cache", ".kv_cache.v_cache")
    names: dict[str, str] = {}
    unknown: list[str] = []
    native = is_native(set(keys))
    for key in keys:
        if key.endswith(ignored):
            continue
        name = key.removeprefix(NATIVE_PREFIX) if native else legacy_to_native(key)
        if name is None:
            unknown.append(key)
        else:
            names[name] = key
    return names, unknown, not native


def load_state(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Read, rename, validate and convert a checkpoint's tensors for ``config``."""
    reader = CheckpointReader(path)
    names, unknown, legacy = _native_names(reader.keys)
    found = {}
    for name, key in names.items():
        shape = reader.shape(key)
        found[name] = shape[::-1] if legacy and name in TRANSPOSED_NATIVE_KEYS else shape
    check_shapes(found, unknown, expected_shapes(config), str(path))
    show = progress and path.stat().st_size > _PROGRESS_BYTES
    state = {}
    for name, key in tqdm(
        names.items(), desc=f"loading {path.name}", unit="tensor", disable=not show
    ):
        value = reader.tensor(key)
        if legacy and name in TRANSPOSED_NATIVE_KEYS:
            value = value.T
        state[name] = value.to(device=device, dtype=dtype).contiguous()
    return state


def load_model(
    source: str | Path,
    *,
    preset_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tokenizer_path: str | Path | None = None,
    progress: bool = True,
    quant: QuantRequest | None = None,
    vision_quant: QuantFormat | None = None,
) -> LoadedModel:
    """Load weights, tokenizer and configuration from ``source``; ``quant``: with the
    decoder's linears in 8 or 4 bits (models/common/quant_load.py); ``vision_quant``: the
    vision tower's too, quantized here (models/common/vision_quant.py)."""
    path = resolve_source(source)
    if path.is_dir():
        config = read_config(path, preset_name)
        weights = weights_file(path)
        directory = path
    else:
        directory = path.parent
        if (directory / CONFIG_FILE).exists():
            config = read_config(directory, preset_name)
        elif preset_name is not None:
            config = preset(preset_name)
        else:
            raise CheckpointError(f"loading the single file {path} needs a preset name")
        weights = path
    tok_path = Path(tokenizer_path) if tokenizer_path else directory / TOKENIZER_FILE
    if not tok_path.exists():
        raise CheckpointError(f"no tokenizer: {tok_path} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as err:
        raise CheckpointError(f"cannot read tokenizer {tok_path}: {err}") from err
    if quant is None:
        state = load_state(weights, config, dtype, device, progress)
    elif quant.stored is None:  # quantized on the device, one weight at a time
        state = load_state(weights, config, torch.bfloat16, "cpu", progress)
    else:
        state = None
    model = build_model(config, state, device, dtype, quant, vision_quant)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, source=str(source))


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor] | None,
    device: torch.device | str,
    dtype: torch.dtype,
    quant: QuantRequest | None = None,
    vision_quant: QuantFormat | None = None,
) -> MoondreamModel:
    """The model of ``config`` holding ``state`` (on ``device`` in ``dtype``; with ``quant``:
    the 16-bit checkpoint to quantize, or None for a stored quantized one); ``vision_quant``:
    its tower's linears quantized once loaded."""
    with torch.device("meta"):
        model = MoondreamModel(config)
    if quant is not None:
        targets = quant_targets(config, vision=quant.stored is not None)
        tensors, model.quantized = quantized_state(quant, state, targets, device, dtype)
        state = install(model, tensors, model.quantized)
    assert state is not None
    model.load_state_dict(state, strict=True, assign=True)
    del state  # the tower's 16-bit weights go with their layers as they are quantized
    model.text.reset_rotary(device)
    model.eval().requires_grad_(False)
    if vision_quant is not None:
        model.quantize_vision(vision_quant)
    return model


def quant_targets(config: ModelConfig, vision: bool) -> list[str]:
    """The weights ``--weights int8|int4`` quantizes: the decoder's block linears (and the
    vision tower's, which a ``vlm quantize --vision`` file holds quantized)."""
    return block_linears(expected_shapes(config), vision)


def random_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    quant: QuantRequest | None = None,
    vision_quant: QuantFormat | None = None,
) -> LoadedModel:
    """Exactly what loading `write_checkpoint(config, seed=seed)` gives (bf16 values), built in
    memory: for benchmarks and GPU tests that need no file. ``quant``, ``vision_quant``:
    quantized at load."""
    shapes = expected_shapes(config)
    state = {}
    for key, shape in tqdm(
        shapes.items(), desc=f"random {config.name}", unit="tensor", disable=not progress
    ):
        value = random_tensor(key, shape, seed, torch.bfloat16)
        # Quantized: the bf16 values stay on the host until each is quantized on the device.
        state[key] = value if quant is not None else value.to(device=device, dtype=dtype)
    model = build_model(config, state, device, dtype, quant, vision_quant)
    return LoadedModel(
        model=model,
        tokenizer=build_tokenizer(config, seed),
        config=config,
        source=f"random:{config.name}:{seed}",
    )
