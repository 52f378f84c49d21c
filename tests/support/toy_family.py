"""A second model family, for tests only: it proves the engine and both doors are generic.

Nothing here is shared with the Moondream families except the synthetic tokenizer builder and
the tiny tokenizer contract (models/common/: a family may speak another family's token era).
The decoder is a different architecture on purpose: sequential pre-norm blocks with RMSNorm,
grouped-query attention (2 KV heads for 4 query heads), full-width rotary, a SiLU-gated MLP and
tied embeddings; the vision path is one linear patch embedding of the global crop; the region
heads are single linear layers. Its checkpoints have their own file names and format marker.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from vlm_server.models.checkpoint_io import CheckpointReader, check_shapes
from vlm_server.models.common.contracts import CONTRACT_TINY
from vlm_server.models.common.memory_shape import memory_shape
from vlm_server.models.common.tokenizer_build import Vocabulary, build_tokenizer
from vlm_server.models.contract import TokenContract
from vlm_server.models.interface import (
    Capabilities,
    FamilyConfig,
    Formats,
    KVShape,
    LoadedModel,
    MemoryShape,
)
from vlm_server.models.kv import KVCache
from vlm_server.models.quant.targets import block_linears

FORMAT = "toy-family/1"
FORMATS = Formats(weights=("bf16", "fp16", "fp32"), kv=("bf16", "fp16", "fp32"))
WEIGHTS = "toy.safetensors"
TOY_LINEARS = re.compile(r"text\.blocks\.\d+\.(q|kv|o|gate_up|down)\.weight")
NO_TOWER = re.compile(r"(?!)")


@dataclass(frozen=True)
class ToyText:
    vocab_size: int = 1024
    max_context: int = 2048
    dim: int = 48
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int = 2
    ff_dim: int = 96

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class ToyVision:
    # The overlap-crop geometry every family served here shares (378-pixel crops).
    crop_size: int = 378
    patch_size: int = 14
    overlap_margin: int = 4
    max_crops: int = 12
    in_channels: int = 3

    @property
    def grid(self) -> int:
        return self.crop_size // self.patch_size


@dataclass(frozen=True)
class ToyConfig:
    name: str = "toy"
    text: ToyText = field(default_factory=ToyText)
    vision: ToyVision = field(default_factory=ToyVision)
    tokens: TokenContract = CONTRACT_TINY

    @property
    def image_prefix_len(self) -> int:
        return 1 + self.vision.grid**2


def _rotary(head_dim: int, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(max_context, dtype=torch.float32)[:, None] * inv[None]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class ToyBlock(nn.Module):
    def __init__(self, t: ToyText) -> None:
        super().__init__()
        self.t = t
        self.attn_norm = nn.RMSNorm(t.dim)
        self.q = nn.Linear(t.dim, t.n_heads * t.head_dim, bias=False)
        self.kv = nn.Linear(t.dim, 2 * t.n_kv_heads * t.head_dim, bias=False)
        self.o = nn.Linear(t.dim, t.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(t.dim)
        self.gate_up = nn.Linear(t.dim, 2 * t.ff_dim, bias=False)
        self.down = nn.Linear(t.ff_dim, t.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        pos: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        t, (b, n, _) = self.t, x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, n, t.n_heads, t.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, t.n_kv_heads, t.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]
        out = cache.attend(layer, _rotate(q, cos, sin), _rotate(k, cos, sin), v, pos)
        x = x + self.o(out.transpose(1, 2).reshape(b, n, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ToyDecoder(nn.Module):
    def __init__(self, t: ToyText) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.zeros(t.vocab_size, t.dim))
        self.blocks = nn.ModuleList(ToyBlock(t) for _ in range(t.n_layers))
        self.norm = nn.RMSNorm(t.dim)
        cos, sin = _rotary(t.head_dim, t.max_context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, (self.rope_cos, self.rope_sin), positions, cache, i)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden), self.wte).float()


class ToyVisionStack(nn.Module):
    def __init__(self, v: ToyVision, dim: int) -> None:
        super().__init__()
        self.v = v
        self.patch = nn.Linear(v.in_channels * v.patch_size**2, dim)

    def encode(self, crops: torch.Tensor) -> torch.Tensor:
        n, c, _, _ = crops.shape
        g, p = self.v.grid, self.v.patch_size
        x = crops.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, -1)
        return self.patch(x.to(self.patch.weight.dtype))

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        return features[0]  # the global crop only


class ToyRegion(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.coord_in = nn.Linear(1, dim)
        self.size_in = nn.Linear(2, dim)
        self.coord_out = nn.Linear(dim, 1024)
        self.size_out = nn.Linear(dim, 2048)

    def encode_coord(self, x: torch.Tensor) -> torch.Tensor:
        return self.coord_in(x.to(self.coord_in.weight.dtype))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        return self.size_in(wh.to(self.size_in.weight.dtype))

    def decode_coord(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.coord_out(hidden)

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.size_out(hidden)


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.text = ToyDecoder(config.text)
        self.vision = ToyVisionStack(config.vision, config.text.dim)
        self.region = ToyRegion(config.text.dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.text.wte.dtype

    @property
    def device(self) -> torch.device:
        return self.text.wte.device

    @property
    def kv_shape(self) -> KVShape:
        t = self.config.text
        return KVShape(t.n_layers, t.n_kv_heads, t.head_dim)

    @property
    def n_heads(self) -> int:
        return self.config.text.n_heads

    @property
    def fused_attention(self) -> bool:
        return False  # its GQA layout is not the CUDA kernels' packed one: CPU only

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(FORMATS)  # nothing optional

    def image_embeddings(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        return self.vision.project(self.vision.encode(crops.to(self.dtype)), tiling)

    def prefix_embeddings(self, image_emb: torch.Tensor) -> torch.Tensor:
        bos = self.config.tokens.bos_id
        return torch.cat([self.text.wte[bos : bos + 1], image_emb], dim=0)[None]


def _random_state(config: ToyConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = ToyModel(config)
    state = {}
    for key, value in model.state_dict().items():
        gen = torch.Generator().manual_seed(seed * 7919 + len(state))
        std = 1.0 if key.endswith("norm.weight") else (value.shape[-1] ** -0.5)
        base = 1.0 if key.endswith("norm.weight") else 0.0
        state[key] = base + std * torch.randn(value.shape, generator=gen) * (0.1 if base else 1.0)
    state["text.wte"] *= 4.0  # tied head: sharper logits make answers differ per prompt
    return state


def _tokenizer(seed: int) -> Tokenizer:
    return build_tokenizer(Vocabulary(CONTRACT_TINY, 1000), seed=seed)  # the tiny vocabulary


def _model(
    config: ToyConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
) -> ToyModel:
    model = ToyModel(config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


class ToyFamily:
    name = "toy"
    formats = FORMATS

    @property
    def presets(self) -> Mapping[str, Callable[[], FamilyConfig]]:
        return {
            "toy": ToyConfig,
            "toy-deep": lambda: ToyConfig(
                name="toy-deep", text=dataclasses.replace(ToyText(), n_layers=5)
            ),
        }

    def owns(self, config: FamilyConfig) -> bool:
        return isinstance(config, ToyConfig)

    def reads(self, meta: Mapping[str, Any]) -> bool:
        return meta.get("format") == FORMAT

    def read_config(self, directory: Path, preset_name: str | None) -> ToyConfig:
        meta = json.loads((directory / "config.json").read_text())
        return ToyConfig(
            name=meta["name"],
            text=ToyText(**meta["text"]),
            vision=ToyVision(**meta["vision"]),
        )

    def memory_shape(self, config: FamilyConfig) -> MemoryShape:
        assert isinstance(config, ToyConfig)
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in ToyModel(config).state_dict().items()}
        t = config.text
        return memory_shape(
            config,
            shapes,
            KVShape(t.n_layers, t.n_kv_heads, t.head_dim),
            qkv_dim=(t.n_heads + 2 * t.n_kv_heads) * t.head_dim,
            ff_dim=2 * t.ff_dim,
            enc_dim=t.dim,
            enc_ff_dim=t.dim,
            proj_inner_dim=t.dim,
            rotary_dim=t.head_dim,
            enc_layers=0,  # its tower is a patch embedding alone
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
    ) -> LoadedModel:
        config = self.read_config(path, preset_name)
        reader = CheckpointReader(path / WEIGHTS)
        want = {k: tuple(v.shape) for k, v in ToyModel(config).state_dict().items()}
        check_shapes({k: reader.shape(k) for k in reader.keys}, [], want, str(path))
        state = {k: reader.tensor(k) for k in reader.keys}
        tok = Tokenizer.from_file(str(tokenizer_path or path / "tokenizer.json"))
        return LoadedModel(_model(config, state, dtype, device), tok, config, str(path))

    def random_model(
        self,
        config: FamilyConfig,
        *,
        seed: int,
        dtype: torch.dtype,
        device: torch.device | str,
        progress: bool,
    ) -> LoadedModel:
        assert isinstance(config, ToyConfig)
        state = _random_state(config, seed)
        return LoadedModel(
            _model(config, state, dtype, device),
            _tokenizer(seed),
            config,
            f"random:{config.name}:{seed}",
        )

    def write_checkpoint(
        self, config: FamilyConfig, out_dir: Path, *, seed: int, progress: bool, **options: Any
    ) -> Path:
        assert isinstance(config, ToyConfig)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in _random_state(config, seed).items()}
        save_file(state, str(out_dir / WEIGHTS))
        _tokenizer(seed).save(str(out_dir / "tokenizer.json"))
        meta = {
            "format": FORMAT,
            "name": config.name,
            "text": dataclasses.asdict(config.text),
            "vision": dataclasses.asdict(config.vision),
        }
        (out_dir / "config.json").write_text(json.dumps(meta))
        return out_dir

    def expected_shapes(self, config: FamilyConfig) -> dict[str, tuple[int, ...]]:
        assert isinstance(config, ToyConfig)
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in ToyModel(config).state_dict().items()}

    def quant_targets(self, config: FamilyConfig, vision: bool) -> list[str]:
        # Its own names: no vision blocks, so ``vision`` adds nothing.
        return block_linears(self.expected_shapes(config), vision, TOY_LINEARS, NO_TOWER)

    def read_state(
        self, path: Path, preset_name: str | None
    ) -> tuple[FamilyConfig, dict[str, torch.Tensor]]:
        config = self.read_config(path, preset_name)
        reader = CheckpointReader(path / WEIGHTS)
        check_shapes(
            {k: reader.shape(k) for k in reader.keys}, [], self.expected_shapes(config), str(path)
        )
        return config, {k: reader.tensor(k).to(torch.bfloat16) for k in reader.keys}


FAMILY = ToyFamily()
