"""Write seeded random Moondream 3 checkpoints in either real layout, with a tokenizer and
config.

* ``layout="hf"``: keys ``model.`` + the model's names, bf16, split into ``shards`` files
  ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (the preview's
  Hugging Face layout).
* ``layout="md3"``: the author's engine's names, experts FP8 with per-row scales, the rest in
  ``dtype``; one ``model.safetensors`` (3.1) or ``model_fp8.pt`` (``file_format="pt"``, the
  preview's), tau matrices separate or fused (``fuse_tau``).

Loading either gives the model `random_model` builds, except that md3 experts went through
FP8 (their values are the quantized ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from vlm_server.models.common.contracts import CONTRACT_TINY
from vlm_server.models.common.random_weights import random_tensor
from vlm_server.models.common.tokenizer_build import Vocabulary, build_tokenizer
from vlm_server.models.moondream3 import fp8_experts
from vlm_server.models.moondream3.config import ModelConfig
from vlm_server.models.moondream3.layout import (
    HF_PREFIX,
    TRANSPOSED,
    expected_shapes,
    expert_key,
    fused_tau_key,
    native_to_md3,
    scale_key,
)

CONFIG_FORMAT = "moondream-serve/1"
FAMILY = "moondream3"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
PT_FILE = "model_fp8.pt"
# The synthetic tokenizers' sizes: the tiny test vocabulary's, and a full-size one.
TINY_VOCAB, FULL_VOCAB = 1000, 51200


_LOUDER = frozenset({"text.wte", "vision.proj_mlp.fc2.weight"})


def random_state(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Native name -> seeded random tensor (each tensor's values depend on its name only)."""
    state = {}
    for key, shape in expected_shapes(config).items():
        value = random_tensor(key, shape, seed, torch.float32)
        if key.endswith(".mlp.fc1.weight") and len(shape) == 3:
            # The two halves of each expert's fc1 differ in scale, so a swap of the GELU and
            # the "+1" halves changes the answer.
            value[:, shape[1] // 2 :] *= 0.25
        elif key in _LOUDER:
            # At the plain scales the tiny model's answers settle on one self-repeating token
            # and ignore the picture; larger token and image embeddings keep them depending
            # on both, so answer-equality tests can tell a wrong attention or cache apart.
            value *= 4.0
        state[key] = value.to(dtype)
    return state


def tokenizer_for(config: ModelConfig, seed: int) -> Tokenizer:
    """The project's synthetic tokenizer with the contract's special ids (the real one is the
    separate ``moondream/starmie-v1``): the tiny test vocabulary, or a full-size one."""
    tiny = config.tokenizer_vocab_size <= 1024
    if config.tokenizer_vocab_size != (TINY_VOCAB if tiny else FULL_VOCAB):
        raise ValueError(f"no synthetic tokenizer of {config.tokenizer_vocab_size} tokens")
    # The full-size one has the 2025-06 layout's special ids, which Moondream 3's contract keeps.
    contract = CONTRACT_TINY if tiny else config.tokens
    return build_tokenizer(Vocabulary(contract, config.tokenizer_vocab_size), seed)


def _md3_tensors(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, fuse_tau: bool
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.split(".")
        if key.startswith("text.blocks.") and parts[3] == "mlp" and value.dim() == 3:
            layer, up = int(parts[2]), parts[4] == "fc1"
            q, s = fp8_experts.quantize(value)
            out[expert_key(layer, up)], out[scale_key(layer, up)] = q, s
            continue
        if fuse_tau and key.endswith(("attn.tau.wq", "attn.tau.wv")):
            layer = int(parts[2])
            if key.endswith("wq"):
                wv = state[f"text.blocks.{layer}.attn.tau.wv"]
                out[fused_tau_key(layer)] = torch.cat([value, wv]).to(dtype)
            continue
        if key in TRANSPOSED:
            value = value.T
        out[native_to_md3(key)] = value.to(dtype).contiguous()
    return out


def write_checkpoint(
    config: ModelConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "hf",
    shards: int = 2,
    fuse_tau: bool = False,
    file_format: str = "safetensors",
    progress: bool = True,
) -> Path:
    """Write the weights, ``tokenizer.json`` and ``config.json`` (last) into ``out_dir``."""
    if layout not in ("hf", "md3"):
        raise ValueError(f"layout must be 'hf' or 'md3', not {layout!r}")
    if file_format not in ("safetensors", "pt"):
        raise ValueError(f"file_format must be 'safetensors' or 'pt', not {file_format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = random_state(config, seed, dtype)
    if layout == "hf":
        keys = list(state)
        per = -(-len(keys) // max(1, shards))
        weight_map = {}
        chunks = [keys[i : i + per] for i in range(0, len(keys), per)]
        for i, chunk in enumerate(tqdm(chunks, desc="writing shards", disable=not progress)):
            name = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
            save_file({HF_PREFIX + k: state[k].contiguous() for k in chunk}, str(out / name))
            weight_map |= {HF_PREFIX + k: name for k in chunk}
        index = {"metadata": {"format": "pt"}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    else:
        tensors = _md3_tensors(config, state, dtype, fuse_tau)
        if file_format == "pt":
            torch.save(tensors, str(out / PT_FILE))
        else:
            save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer_for(config, seed).save(str(out / TOKENIZER_FILE))
    meta = {
        "format": CONFIG_FORMAT,
        "family": FAMILY,
        "seed": seed,
        "random_weights": True,
        "layout": layout,
        "model": config.to_dict(),
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out
