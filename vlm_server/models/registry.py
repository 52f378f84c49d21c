"""The registry of model families: which family a preset, a config or a checkpoint belongs to.

A family (Moondream 2, Moondream 3) is one line of the table in models/families.py, naming its
`ModelFamily`: its presets, how it recognises its own checkpoints, the formats it accepts, and
how it loads, generates and writes them. The server, the command line, the benchmarks and the
tests reach families through here; the engine never does (it is typed against
`models/interface.py` only, and a loaded model declares its optional parts there).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from vlm_server.models import capabilities
from vlm_server.models.checkpoint_io import CheckpointError
from vlm_server.models.common import quant_plan
from vlm_server.models.common.quant_load import QuantRequest
from vlm_server.models.families import FAMILIES
from vlm_server.models.hub import resolve_file, resolve_source
from vlm_server.models.interface import (
    FamilyConfig,
    Formats,
    LoadedModel,
    MemoryShape,
    SegmentRefine,
)
from vlm_server.models.quant.files import check_quantized
from vlm_server.models.quant.formats import GROUP_SIZE, QuantFormat

CONFIG_FILE = "config.json"


class ModelFamily(Protocol):
    """One model family, as the registry drives it."""

    name: str
    formats: Formats  # the weight and KV formats it accepts, known before anything loads

    @property
    def presets(self) -> Mapping[str, Callable[[], FamilyConfig]]:
        """Named configurations (dimensions, token contract) of this family."""
        ...

    def owns(self, config: FamilyConfig) -> bool:
        """Whether ``config`` is one of this family's configurations."""
        ...

    def reads(self, meta: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's ``config.json`` (parsed) belongs to this family."""
        ...

    def read_config(self, directory: Path, preset_name: str | None) -> FamilyConfig:
        """A checkpoint directory's configuration (its config.json, or the preset), without
        reading its weights."""
        ...

    def memory_shape(self, config: FamilyConfig) -> MemoryShape:
        """What the memory plan reads of ``config``'s model (parameters from the model built
        on the meta device: nothing allocated)."""
        ...

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
        """Load a local checkpoint (a directory or one weights file); ``quant``: with its
        decoder's linears in 8 or 4 bits (only a format of ``formats.quantized``; a family
        that declares none is never passed it); ``experts_fp8``: its experts in FP8 (only
        passed to a family whose ``formats.fp8_experts`` says it can); ``vision_quant``: its
        vision tower's linears quantized at load (only a format of
        ``formats.vision_quantized``)."""
        ...

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
        """What loading `write_checkpoint(config, seed=seed)` gives, built in memory;
        ``quant``: quantized as at load (never ``stored``); ``experts_fp8`` and
        ``vision_quant`` as for `load`."""
        ...

    def write_checkpoint(
        self, config: FamilyConfig, out_dir: Path, *, seed: int, progress: bool, **options: Any
    ) -> Path:
        """Write a seeded random checkpoint in the family's real layout (``options``: the
        family's own, e.g. dtype or layout)."""
        ...

    def expected_shapes(self, config: FamilyConfig) -> dict[str, tuple[int, ...]]:
        """The model's tensors (the family's own names) and their shapes, nothing allocated."""
        ...

    def quant_targets(self, config: FamilyConfig, vision: bool) -> list[str]:
        """The weights ``--weights int8|int4`` quantizes (models/quant/targets.py): the
        decoder's linears, experts included, and the vision tower's when ``vision``."""
        ...

    def read_state(
        self, path: Path, preset_name: str | None
    ) -> tuple[FamilyConfig, dict[str, torch.Tensor]]:
        """Every tensor of a local checkpoint in any layout the family loads, under its own
        names, in bf16 on the CPU (FP8 experts dequantized), with its configuration."""
        ...


REFINER_FILE = "model.pt"
# ``--dtype``'s names of the weight formats (models/interface.py `WeightFormat`).
FORMAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def families() -> list[ModelFamily]:
    """The families of the table, in its order (each preset belongs to one family)."""
    found: list[ModelFamily] = []
    for name, module in FAMILIES.items():
        fam: ModelFamily = importlib.import_module(module).FAMILY
        if fam.name != name:
            raise ValueError(f"{module}.FAMILY is named {fam.name!r}, not {name!r}")
        clash = {p for f in found for p in f.presets} & set(fam.presets)
        if clash:
            raise ValueError(f"family {name!r}: presets {sorted(clash)} are taken")
        found.append(fam)
    return found


def family(name: str) -> ModelFamily:
    for fam in families():
        if fam.name == name:
            return fam
    raise ValueError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")


def preset_names() -> list[str]:
    """Every registered family's presets."""
    return sorted(p for f in families() for p in f.presets)


def family_for_preset(name: str) -> ModelFamily:
    for fam in families():
        if name in fam.presets:
            return fam
    raise ValueError(f"unknown preset {name!r}; choose one of {preset_names()}")


def preset(name: str) -> FamilyConfig:
    """The named preset configuration, whichever family defines it."""
    return family_for_preset(name).presets[name]()


def family_of(config: FamilyConfig) -> ModelFamily:
    for fam in families():
        if fam.owns(config):
            return fam
    raise ValueError(f"no registered model family owns the configuration {config.name!r}")


def memory_shape(config: FamilyConfig) -> MemoryShape:
    """What the engine's memory plan reads of ``config``'s model, from its family."""
    return family_of(config).memory_shape(config)


def checkpoint_config(directory: str | Path, preset_name: str | None = None) -> FamilyConfig:
    """The configuration of a local checkpoint directory (its config.json, or ``preset_name``
    for a snapshot that carries none the family trusts); its weights are never read."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    fam = family_for_preset(preset_name) if preset_name else _family_of_checkpoint(path)
    return fam.read_config(path, preset_name)


def load_model(
    source: str | Path,
    *,
    preset_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tokenizer_path: str | Path | None = None,
    progress: bool = True,
    weights: str | None = None,
    group_size: int = GROUP_SIZE,
    vision_weights: str = "exact",
) -> LoadedModel:
    """Load a checkpoint: a directory, one weights file or a Hugging Face repo id. The family
    is the preset's when one is named, else the one that reads the checkpoint's config.json.
    ``weights`` (``--weights``): bf16 (the checkpoint's values, in ``dtype``), int8 / int4
    (the decoder's linears quantized at load, INT4 in groups of ``group_size``), fp8 (the
    experts in FP8: kept from an FP8 checkpoint, quantized at load from a 16-bit one); None: the
    checkpoint's own (a ``vlm quantize`` directory's format, else bf16). A quantized
    directory is served as it is, never re-quantized. ``vision_weights``
    (``--vision-weights``): exact, or int8 / int4: the vision tower's linears quantized at
    load (INT4 in groups of ``group_size``)."""
    path = resolve_source(source)
    fam = family_for_preset(preset_name) if preset_name else _family_of_checkpoint(path)
    _check_dtype(fam, dtype)
    quant = quant_plan.request(fam.name, fam.formats, path, weights, group_size, device)
    tower = quant_plan.vision_request(
        fam.name, fam.formats, vision_weights, group_size, device, quant
    )
    if quant is not None and quant.stored is not None:
        config = fam.read_config(path if path.is_dir() else path.parent, preset_name)
        check_quantized(quant.stored, fam.expected_shapes(config), str(path))
    # A family asked for no quantized format never sees the argument: one that declares none
    # need not take it.
    asked = _asked(quant, weights, tower)
    loaded = fam.load(
        path,
        preset_name=preset_name,
        dtype=dtype,
        device=device,
        tokenizer_path=tokenizer_path,
        progress=progress,
        **asked,
    )
    loaded.source = str(source)
    return loaded


def random_model(
    config: FamilyConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    weights: str | None = None,
    group_size: int = GROUP_SIZE,
    vision_weights: str = "exact",
) -> LoadedModel:
    """A seeded random model of ``config``, in memory (benchmarks, GPU tests); ``weights``
    and ``vision_weights`` as `load_model` takes them (int8 / int4: quantized as at load)."""
    fam = family_of(config)
    _check_dtype(fam, dtype)
    quant = quant_plan.request(fam.name, fam.formats, None, weights, group_size, device)
    tower = quant_plan.vision_request(
        fam.name, fam.formats, vision_weights, group_size, device, quant
    )
    return fam.random_model(
        config,
        seed=seed,
        dtype=dtype,
        device=device,
        progress=progress,
        **_asked(quant, weights, tower),
    )


def _asked(
    quant: QuantRequest | None, weights: str | None, tower: QuantFormat | None
) -> dict[str, Any]:
    """The keywords of a family's load for ``weights`` and the tower's format: a family asked
    for no quantized format never sees ``quant``, one asked for no FP8 experts never sees
    ``experts_fp8``, one asked for an exact tower never sees ``vision_quant`` (one that
    declares none of them need not take them; quant_plan refused what it does not serve)."""
    asked: dict[str, Any] = {} if quant is None else {"quant": quant}
    if weights == "fp8":
        asked["experts_fp8"] = True
    if tower is not None:
        asked["vision_quant"] = tower
    return asked


def write_checkpoint(
    config: FamilyConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    progress: bool = True,
    **options: Any,
) -> Path:
    """Write a seeded random checkpoint of ``config`` in its family's layout."""
    return family_of(config).write_checkpoint(
        config, Path(out_dir), seed=seed, progress=progress, **options
    )


def segment_refiner(loaded: LoadedModel, source: str | Path) -> SegmentRefine:
    """``loaded``'s family's segmentation refiner, its head read from ``source``: a file, a
    directory holding ``model.pt``, or a Hugging Face repo id (``moondream/SegHeadRefiner``)."""
    make = capabilities.need(
        loaded.model.capabilities.segment_refiner, "segment_refiner", loaded.model
    )
    try:
        weights = resolve_file(source, REFINER_FILE)
    except CheckpointError as err:
        raise ValueError(f"segment_refiner: {err}") from None
    return make(weights)


def _check_dtype(fam: ModelFamily, dtype: torch.dtype) -> None:
    name = FORMAT_NAMES.get(dtype)
    if name is None:
        raise capabilities.CapabilityError(f"no weight format is {dtype}")
    capabilities.check_formats(fam.formats, fam.name, name)


def _family_of_checkpoint(path: Path) -> ModelFamily:
    directory = path if path.is_dir() else path.parent
    config = directory / CONFIG_FILE
    if not config.exists():
        raise CheckpointError(
            f"{directory} has no {CONFIG_FILE}; name a preset (one of {preset_names()})"
        )
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {config}: {err}") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{config} does not hold a JSON object")
    for fam in families():
        if fam.reads(meta):
            return fam
    raise CheckpointError(
        f"no model family reads {config}; name a preset (one of {preset_names()})"
    )
