"""Load a Moondream 3 checkpoint in either layout into a `Moondream3Model`.

Sources: a directory (sharded safetensors with ``model.safetensors.index.json``, one
``model.safetensors``, or ``model_fp8.pt``; ``tokenizer.json``; ``config.json``), or one
weights file. The layout is told by the keys (`layout.is_md3_layout`). Every tensor's shape is
checked from the file headers before any is read, and one `CheckpointError` names every
missing, unexpected and mis-shaped tensor. FP8 experts are dequantized (``q * s``) into the
model's dtype as they are read, except where the fused kernels can read them as they are (a
CUDA device with FP8 units, and Triton): there they stay FP8 with their scales. With 8- or
4-bit weights (``quant``) the whole decoder's block linears, experts included, are held in
that format: quantized at load from the 16-bit (or dequantized FP8) values, or read as stored.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from vlm_server.models.capabilities import CapabilityError
from vlm_server.models.checkpoint_io import (
    CheckpointError,
    CheckpointReader,
    check_shapes,
    indexed_files,
)
from vlm_server.models.common.quant_load import QuantRequest, install, quantized_state
from vlm_server.models.interface import LoadedModel, QuantizedWeights
from vlm_server.models.moondream3 import fp8_experts, moe_triton
from vlm_server.models.moondream3.config import ModelConfig, preset
from vlm_server.models.moondream3.layout import (
    FUSED_TAU,
    HF_PREFIX,
    KV_SCALE,
    MOE_SCALE,
    TRANSPOSED,
    expected_shapes,
    is_md3_layout,
    md3_to_native,
    scale_key,
)
from vlm_server.models.moondream3.model import Moondream3Model
from vlm_server.models.moondream3.moe import ExpertBank
from vlm_server.models.moondream3.writer import (
    CONFIG_FILE,
    CONFIG_FORMAT,
    FAMILY,
    INDEX_FILE,
    PT_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    random_state,
    tokenizer_for,
)
from vlm_server.models.quant.formats import weight_format
from vlm_server.models.quant.targets import block_linears

DEFAULT_PRESET = "moondream3-preview"


def read_config(directory: Path, preset_name: str | None) -> ModelConfig:
    """The project's own config.json, else the named preset (a Hugging Face snapshot's
    config.json is not trusted: its structure is not established, and the preset is)."""
    path = directory / CONFIG_FILE
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from err
        if isinstance(data, dict) and data.get("format") == CONFIG_FORMAT:
            if data.get("family") != FAMILY:
                raise CheckpointError(f"{path} is not a Moondream 3 checkpoint")
            config = ModelConfig.from_dict(data["model"])
            if preset_name is not None and preset(preset_name).text != config.text:
                raise CheckpointError(
                    f"{path} describes model {config.name!r}, whose decoder differs from the "
                    f"requested preset {preset_name!r}"
                )
            return config
    return preset(preset_name or DEFAULT_PRESET)


def weight_files(path: Path) -> list[Path]:
    """The weights files of a checkpoint directory (or the one file given)."""
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.exists():
        return indexed_files(index)
    for name in (WEIGHTS_FILE, PT_FILE, "model.pt"):
        if (path / name).exists():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    raise CheckpointError(
        f"{path} holds no {INDEX_FILE}, {WEIGHTS_FILE} or {PT_FILE}"
        + (f" (and several .safetensors: {[f.name for f in found]})" if found else "")
    )


class _Plan:
    """Where each native tensor comes from, and the shapes found, before reading any."""

    def __init__(self, readers: list[CheckpointReader], config: ModelConfig) -> None:
        self.config = config
        self.where: dict[str, CheckpointReader] = {k: r for r in readers for k in r.keys}
        keys = set(self.where)
        self.md3 = is_md3_layout(keys)
        self.names: dict[str, str] = {}  # native -> file key
        self.fused: dict[int, str] = {}  # layer -> fused tau key
        self.unknown: list[str] = []
        self.found: dict[str, tuple[int, ...]] = {}
        for key in sorted(keys):
            self._place(key)

    def _place(self, key: str) -> None:
        shape = self.where[key].shape(key)
        if not self.md3:
            name = key.removeprefix(HF_PREFIX)
            self.names[name], self.found[name] = key, shape
            return
        if KV_SCALE.fullmatch(key):
            return  # FP8 KV-cache scales: the cache here keeps the activation dtype
        if m := FUSED_TAU.fullmatch(key):
            self.fused[int(m[1])] = key
            self.found[key] = shape
            return
        if MOE_SCALE.fullmatch(key):
            self.found[key] = shape
            return
        name = md3_to_native(key)
        if name is None:
            self.unknown.append(key)
            return
        self.names[name] = key
        self.found[name] = shape[::-1] if name in TRANSPOSED else shape

    def expected(self) -> dict[str, tuple[int, ...]]:
        want = expected_shapes(self.config)
        if not self.md3:
            return want
        t = self.config.text
        for layer, key in self.fused.items():  # one [q heads + kv heads, qkv] matrix
            want.pop(f"text.blocks.{layer}.attn.tau.wq", None)
            want.pop(f"text.blocks.{layer}.attn.tau.wv", None)
            want[key] = (t.n_heads + t.n_kv_heads, t.qkv_dim)
        for name, shape in list(want.items()):  # every expert matrix has its row scales
            if len(shape) == 3 and ".mlp.fc" in name:
                layer, up = int(name.split(".")[2]), name.endswith("fc1.weight")
                want[scale_key(layer, up)] = shape[:2]
        return want

    def read(
        self,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        keep_fp8: bool,
        fp8: dict[str, torch.Tensor],
        to_fp8: bool = False,
    ) -> torch.Tensor:
        """One native tensor in ``dtype`` on ``device``; an FP8 expert matrix stays FP8 when
        ``keep_fp8`` (its scales go into ``fp8``, under the same name), and a 16-bit one is
        quantized to FP8 when ``to_fp8`` (``--weights fp8``)."""
        parts = name.split(".")
        fused = self.fused.get(int(parts[2])) if name.endswith(("tau.wq", "tau.wv")) else None
        if fused is not None:
            key = fused
            both = self.where[key].tensor(key)
            n_q = self.config.text.n_heads
            value = both[:n_q] if name.endswith("wq") else both[n_q:]
        else:
            key = self.names[name]
            value = self.where[key].tensor(key)
        if name in TRANSPOSED and self.md3:
            value = value.T
        value = value.to(device)
        if self.md3 and len(value.shape) == 3 and ".mlp.fc" in name:
            skey = scale_key(int(parts[2]), parts[4] == "fc1")
            scale = self.where[skey].tensor(skey).to(device)
            if keep_fp8 and value.dtype == fp8_experts.FP8:
                fp8[name] = scale.float()
                return value.contiguous()
            return fp8_experts.dequantize(value, scale, dtype).contiguous()
        if to_fp8 and _is_expert(name, value):
            q, fp8[name] = fp8_experts.quantize(value)
            return q.contiguous()
        return value.to(dtype).contiguous()


def _is_expert(name: str, value: torch.Tensor) -> bool:
    """Whether ``name`` is a stack of expert matrices ([E, N, K])."""
    return value.dim() == 3 and ".mlp.fc" in name


def fused_fp8(device: torch.device | str) -> bool:
    """Whether expert weights are best kept in FP8 on ``device``: the kernels take them
    there, and Triton is present."""
    dev = torch.device(device)
    return fp8_experts.fp8_experts_supported(dev) and moe_triton.triton is not None


def check_fp8(device: torch.device | str) -> None:
    """Refuse ``--weights fp8`` where the fused expert kernels cannot read FP8 weights."""
    if not fused_fp8(device):
        raise CapabilityError(
            f"--weights fp8: FP8 experts need a GPU with FP8 units (compute capability "
            f"{'.'.join(map(str, fp8_experts.FP8_EXPERTS_CAPABILITY))} or newer) and Triton; "
            f"{torch.device(device)} has neither or lacks one (use bf16, int8 or int4)"
        )


def load_state(
    files: list[Path],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_fp8: bool = False,
    to_fp8: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read, rename, validate and convert a checkpoint's tensors for ``config``: (native name
    -> tensor, expert matrix kept in FP8 -> its row scales); ``to_fp8``: 16-bit experts
    quantized to FP8 too."""
    plan = _Plan([CheckpointReader(f) for f in files], config)
    source = str(files[0].parent if len(files) > 1 else files[0])
    check_shapes(plan.found, plan.unknown, plan.expected(), source)
    fp8: dict[str, torch.Tensor] = {}
    shapes = expected_shapes(config)
    state = {n: plan.read(n, dtype, device, keep_fp8, fp8, to_fp8) for n in shapes}
    return state, fp8


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device | str,
    fp8: dict[str, torch.Tensor] | None = None,
    quantized: QuantizedWeights | None = None,
) -> Moondream3Model:
    """The model holding ``state`` (its FP8 experts' row scales in ``fp8``; ``quantized``:
    the 4- or 8-bit weights among it, under the file's names: `quantized_state`)."""
    with torch.device("meta"):
        model = Moondream3Model(config)
    if quantized is not None:
        fmt = weight_format(quantized.format, quantized.group_size)
        experts = set(expert_targets(config)) & set(quantized.weights)
        for name in sorted(experts):  # the banks take their stored values and scales
            bank = model.get_submodule(name.removesuffix(".weight"))
            assert isinstance(bank, ExpertBank)
            bank.hold_quantized(fmt)
        linears = tuple(n for n in quantized.weights if n not in experts)
        state = install(model, state, replace(quantized, weights=linears))
        model.quantized = quantized
    plain = {k: v for k, v in state.items() if k not in (fp8 or {})}
    model.load_state_dict(plain, strict=False, assign=True)
    for name, scale in (fp8 or {}).items():
        model.get_submodule(name.removesuffix(".weight")).set_fp8(state[name], scale)
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise CheckpointError(f"tensors not loaded: {missing[:8]}")
    model.text.reset_rotary(device)
    return model.eval().requires_grad_(False)


def load_model(
    path: Path,
    *,
    preset_name: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tokenizer_path: str | Path | None = None,
    quant: QuantRequest | None = None,
    experts_fp8: bool = False,
) -> LoadedModel:
    """Load weights, tokenizer and configuration from a local directory or weights file;
    ``quant``: the decoder's block linears in 8 or 4 bits, experts included (`quant_targets`);
    ``experts_fp8``: the experts in FP8 (``--weights fp8``), kept or quantized here."""
    directory = path if path.is_dir() else path.parent
    config = read_config(directory, preset_name)
    tok_path = Path(tokenizer_path) if tokenizer_path else directory / TOKENIZER_FILE
    if not tok_path.exists():
        raise CheckpointError(
            f"no tokenizer: {tok_path} does not exist (Moondream 3 uses the separate "
            "moondream/starmie-v1 tokenizer; pass its tokenizer.json)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as err:
        raise CheckpointError(f"cannot read tokenizer {tok_path}: {err}") from err
    files = weight_files(path)
    if experts_fp8:
        check_fp8(device)
    if quant is None:
        keep = fused_fp8(device)
        state, fp8 = load_state(files, config, dtype, device, keep, experts_fp8)
        return LoadedModel(build_model(config, state, device, fp8), tokenizer, config, str(path))
    state: dict[str, torch.Tensor] = {}
    if quant.stored is None:  # 16-bit on the host (FP8 experts dequantized), then quantized
        state, _ = load_state(files, config, torch.bfloat16, "cpu")
    return LoadedModel(
        _quantized_model(config, state, device, dtype, quant), tokenizer, config, str(path)
    )


def quant_targets(config: ModelConfig) -> list[str]:
    """The weights ``--weights int8|int4`` holds quantized: the decoder's block linears (every
    block's attention, the dense layers' MLPs and the expert stacks)."""
    return block_linears(expected_shapes(config), vision=False)


def dense_targets(config: ModelConfig) -> list[str]:
    """`quant_targets`' dense linears ([out, in]; the memory plan counts the experts apart)."""
    shapes = expected_shapes(config)
    return [name for name in quant_targets(config) if len(shapes[name]) == 2]


def expert_targets(config: ModelConfig) -> list[str]:
    """`quant_targets`' expert stacks ([E, out, in], held by `ExpertBank`s)."""
    shapes = expected_shapes(config)
    return [name for name in quant_targets(config) if len(shapes[name]) == 3]


def _quantized_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    quant: QuantRequest,
) -> Moondream3Model:
    """The model with its block linears in ``quant``'s format, from the 16-bit ``state`` on
    the host (quantized one weight at a time on ``device``) or a stored file."""
    tensors, quantized = quantized_state(quant, state, quant_targets(config), device, dtype)
    return build_model(config, tensors, device, None, quantized)


def random_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    quant: QuantRequest | None = None,
    experts_fp8: bool = False,
) -> LoadedModel:
    """Exactly what loading the Hugging Face layout of `write_checkpoint(config, seed=seed)`
    gives (bf16 values), built in memory; ``quant``: quantized as at load; ``experts_fp8``:
    its experts in FP8, as ``--weights fp8`` loads them."""
    state = random_state(config, seed, torch.bfloat16)
    if experts_fp8:
        check_fp8(device)
        fp8: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if _is_expert(name, value):
                state[name], fp8[name] = fp8_experts.quantize(value.to(device))
        placed = {
            k: v.to(device) if k in fp8 else v.to(device=device, dtype=dtype)
            for k, v in state.items()
        }
        model = build_model(config, placed, device, fp8)
    elif quant is not None:
        model = _quantized_model(config, state, device, dtype, quant)
    else:
        placed = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        model = build_model(config, placed, device)
    return LoadedModel(
        model,
        tokenizer_for(config, seed),
        config,
        f"random:{config.name}:{seed}",
    )
